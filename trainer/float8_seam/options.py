"""Which `[float8]` options each implementation runs: the config checks' float8 rules.

torch-free and importing nothing of the trainer, so trainer/config/checks.py refuses a bad
combination when the config is read, before torch loads.
"""

from __future__ import annotations

from typing import Protocol


class Float8Options(Protocol):
    """What these rules read of `[float8]` (trainer.config.Float8TrainingConfig)."""

    enabled: bool
    impl: str
    filter: str
    scaling: str


def unsupported_option(f8: Float8Options, float8_stats_freq: int) -> str | None:
    """Why the implementation `f8.impl` cannot run these options, or None: the blockwise recipe,
    filter = 'auto' and float8 health are this repository's float8 package's alone."""
    if not (f8.enabled and f8.impl == "torchao"):
        return None
    if f8.scaling == "blockwise":
        return ("float8.scaling = 'blockwise' is this repository's float8 package's (torchao.float8 has no such recipe; "
                "its blockwise prototype is a separate linear without float8 all-gather): with float8.impl = 'torchao' "
                "pick tensorwise, rowwise or rowwise_gw_hp")
    if f8.filter == "auto":
        return ("float8.filter = 'auto' times this repository's float8 linears, not torchao's: "
                "with float8.impl = 'torchao' set float8.filter = 'rules'")
    if float8_stats_freq:
        return (f"metrics.float8_stats_freq = {float8_stats_freq}: float8 health comes from "
                "this repository's float8 casts, torchao's report none: with float8.impl = 'torchao' "
                "set metrics.float8_stats_freq = 0")
    return None


def health_cost_note(f8: Float8Options, float8_stats_freq: int, compile_mode: str) -> str | None:
    """What float8 health costs a run compiled per block, or None."""
    if f8.enabled and float8_stats_freq and compile_mode == "block":
        return (f"metrics.float8_stats_freq = {float8_stats_freq} with compile.mode = 'block': every block "
                "recompiles for the steps that record float8 health, which can make a short run several times "
                "slower; raise float8_stats_freq, or set it to 0 for speed")
    return None
