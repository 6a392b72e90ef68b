"""The loss series of scripts/loss_compare.py's runs and the numbers read off them: the tail mean,
gaps, moving averages, held-out losses by step, and which run is the bf16 baseline of a seed.

A run is a dict as loss_compare.json keeps it (report.py says which keys).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from scripts.harness.cells import BASELINE


def default_window(steps: int) -> int:
    return max(1, steps // 20)


def tail_steps(steps: int) -> int:
    """How many of the last steps the final training loss averages: 10 %, at least 1."""
    return max(1, steps // 10)


def finite(steps: list[int], losses: list[float | None]) -> tuple[list[int], list[float]]:
    """The (step, loss) pairs with a finite loss (metrics.jsonl writes NaN and inf as null)."""
    pairs = [(s, x) for s, x in zip(steps, losses) if x is not None and math.isfinite(x)]
    return [s for s, _ in pairs], [x for _, x in pairs]


def tail_mean(steps: list[int], losses: list[float | None], total_steps: int) -> float | None:
    """Mean loss over steps > total_steps - tail_steps(total_steps); None when none is finite."""
    first = total_steps - tail_steps(total_steps)
    tail = [x for s, x in zip(*finite(steps, losses)) if s > first]
    return statistics.fmean(tail) if tail else None


def relative_gap_pct(value: float | None, base: float | None) -> float | None:
    """100 * (value - base) / |base|; None when either is missing or base is 0."""
    if value is None or base is None or base == 0:
        return None
    return 100.0 * (value - base) / abs(base)


def moving_average(steps: list[int], losses: list[float | None], window: int) -> dict[int, float]:
    """Trailing mean of `window` consecutive finite losses, keyed by the step that ends the window."""
    steps, losses = finite(steps, losses)
    return {steps[i]: statistics.fmean(losses[i + 1 - window:i + 1]) for i in range(window - 1, len(losses))}


def worst_window_gap(base: dict[int, float], other: dict[int, float]) -> tuple[float, int] | None:
    """(gap %, step) of the largest |gap| between two moving averages at their common steps; first wins ties."""
    worst = None
    for step in sorted(base.keys() & other.keys()):
        gap = relative_gap_pct(other[step], base[step])
        if gap is not None and (worst is None or abs(gap) > abs(worst[0])):
            worst = (gap, step)
    return worst


def validation_of(run: dict[str, Any]) -> dict[int, float]:
    """The run's held-out losses by step (JSON keys are strings), finite ones only."""
    return {int(s): x for s, x in (run.get("validation_loss") or {}).items()
            if x is not None and math.isfinite(x)}


def series_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    """train_steps, train_loss and validation_loss of metrics.jsonl records, by step."""
    records = sorted((r for r in records if isinstance(r.get("step"), int)), key=lambda r: r["step"])
    return {
        "train_steps": [r["step"] for r in records],
        "train_loss": [r.get("loss") for r in records],
        "validation_loss": {str(r["step"]): r["validation/loss"] for r in records
                            if isinstance(r.get("validation/loss"), (int, float))},
    }


def baseline_of(runs: list[dict[str, Any]], seed: int | None = None) -> dict[str, Any] | None:
    """The ok bf16 run of `seed` (None: of the config's seed)."""
    return next((r for r in runs if r["precision"] == BASELINE and r["ok"] and r.get("seed") == seed), None)


def run_label(run: dict[str, Any]) -> str:
    return run["precision"] if run.get("seed") is None else f"{run['precision']} seed {run['seed']}"

