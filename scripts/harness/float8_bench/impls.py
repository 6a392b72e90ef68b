"""The float8 implementations a benchmark can compare: this repository's `float8` package
and the reference library, torchao's `torchao.float8` (optional: pip install -e ".[reference]").

Both convert the same modules in place with the same recipe; torchao's side is the trainer's
(`[float8] impl = "torchao"`, trainer/float8_seam/reference.py), which maps the recipes:

    ours            torchao
    tensorwise      Float8LinearConfig()                                  (its default)
    rowwise         Float8LinearConfig.from_recipe_name("rowwise")
    rowwise_gw_hp   Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")
"""

from __future__ import annotations

import typing

from torch import nn

from float8 import Float8Config, convert_to_float8_training, raise_dynamo_recompile_limit
from trainer.config import Float8Impl
from trainer.float8_seam.reference import ReferenceMissing, torchao_config
from trainer.float8_seam.reference import torchao_version as reference_version

IMPLS = typing.get_args(Float8Impl)
__all__ = ["IMPLS", "ReferenceMissing", "convert", "torchao_version"]


def torchao_version() -> str:
    """The installed torchao's version; raises ReferenceMissing with the install command."""
    return reference_version("--impl torchao")


def convert(module: nn.Module, scaling: str, impl: str) -> nn.Module:
    """Convert `module`'s linears to float8 training linears of `impl` with recipe `scaling`."""
    if impl == "ours":
        config = Float8Config(scaling=scaling, filter_fqns=[])
        # What the trainer does: the self-compiled eager casts need more variants than
        # dynamo's default allows per function.
        raise_dynamo_recompile_limit(config.dynamo_recompile_limit)
        convert_to_float8_training(module, config=config)
        return module
    torchao_version()
    from torchao.float8 import convert_to_float8_training as torchao_convert

    torchao_convert(module, config=torchao_config(scaling))
    return module
