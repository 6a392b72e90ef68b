"""The package's torch ops (namespace `float8_training`): ops torch.compile calls as they are.

Defined on a `torch.library.Library` with one CompositeExplicitAutograd kernel and a fake, not
with `torch.library.custom_op`: a custom op's call goes through Python twice (its autograd
layer, then its kernel), about 35 us of host time a call on an H100 machine's CPU against about
8 us here (docs/benchmarks.md, "The float8 ops' host time"), and rowwise and blockwise steps
call these ops hundreds of times, enough for the host to pace them. None of them has a
gradient: they run inside the float8 linear's autograd.Function, on tensors that need none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_LIBRARY = torch.library.Library("float8_training", "DEF")


def define_op(name: str, kernel: Callable, fake: Callable, tags: Sequence[torch.Tag] = ()) -> Callable:
    """`kernel` as the op `float8_training::name`, its schema from its type hints (no input mutated)
    and `fake` computing its outputs' shapes, strides and dtypes without data."""
    _LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=()), tags=tuple(tags))
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"float8_training::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.float8_training, name).default
