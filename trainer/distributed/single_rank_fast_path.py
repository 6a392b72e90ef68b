"""The one-GPU fast path: FSDP2 at a data-parallel degree of 1 without the work one rank does not need.

Why: with one rank FSDP2 still runs its N-rank machinery around collectives it skips. Its
unshard casts each shard into a new tensor and copies that into the unsharded storage, one
parameter at a time (~20 ms of a 16-layer LLaMA-2-7B bf16 step on one H200); its gradient
reduction copies the packed gradients into a second buffer (the packing itself is
gradient_packing.py's at every rank count). Two patches remove that work and change no
value (bitwise FSDP's results: test_single_rank_gather.py, test_single_rank_reduce.py and test_single_rank_fast_path.py
in tests/trainer/distributed/):

- single_rank_gather.py mirrors `FSDPParamGroup.wait_for_unshard` (torch/distributed/fsdp/
  _fully_shard/_fsdp_param_group.py) and the world-size-1 branch of `FSDPParam`'s
  all-gather-output setup (_fsdp_param.py): one `_foreach_copy_` per group, no copy at all for
  float8 weight shards kept between all-gathers. It replaces the method on the instances of
  the model's one-rank groups only.
- single_rank_reduce.py removes the world-size-1 copy of `foreach_reduce` (torch/distributed/
  fsdp/_fully_shard/_fsdp_collectives.py) through FSDP's public `set_custom_reduce_scatter`: the
  reduction's output is its input's buffer.

Both read FSDP2's private names, which change between torch releases: they are applied only
on the torch versions they were tested with (TESTED_TORCH, by major.minor), and only when
`parallelism.single_rank_fast_path` is on; elsewhere the run is plain FSDP2 and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# (major, minor) of the torch releases the patches of FSDP2's internals were tested with (the CI's three
# torches: the lowest supported, the CPU build, and what `pip install -e .` brings today).
TESTED_TORCH: tuple[tuple[int, int], ...] = ((2, 11), (2, 13), (2, 14))
_NAMES = [f"{major}.{minor}" for major, minor in TESTED_TORCH]
# As the startup summary and the dry run name them: "2.11, 2.13 and 2.14".
TESTED_TORCH_TEXT = f"{', '.join(_NAMES[:-1])} and {_NAMES[-1]}"


def torch_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as '2.13.0+cpu' or '2.14.0a0+git1234'."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def tested_torch(version: str) -> bool:
    """Whether the patches of FSDP2's internals were tested with this torch version (by major.minor)."""
    return torch_minor(version) in TESTED_TORCH


@dataclass(frozen=True)
class FastPath:
    """Whether the run takes the one-GPU fast path, and the text the summary and dry run print."""

    on: bool
    text: str | None  # None when the data-parallel degree is above 1 (the fast path is not a question)


def choose_fast_path(enabled: bool, dp: int, torch_version: str = torch.__version__) -> FastPath:
    """The fast path for a run of data-parallel degree `dp` with the switch `enabled`."""
    if dp != 1:
        return FastPath(on=False, text=None)
    if not enabled:
        return FastPath(on=False, text="single-rank fast path off (parallelism.single_rank_fast_path = false)")
    if not tested_torch(torch_version):
        return FastPath(
            on=False,
            text=f"single-rank fast path off: torch {torch_version} is not one it was tested with ({TESTED_TORCH_TEXT}); plain FSDP2",
        )
    return FastPath(on=True, text="single-rank fast path on")


def apply_fast_path(model: nn.Module) -> None:
    """Give every FSDP module of `model`, sharded over one rank, both patches."""
    # Imported here: on an untested torch the private names they import may not exist.
    from trainer.distributed.single_rank_gather import use_single_rank_gather
    from trainer.distributed.single_rank_reduce import use_single_rank_reduction

    use_single_rank_gather(model)
    use_single_rank_reduction(model)
