"""scripts/gpu_check.py's verdicts: how many steps each check reads and how close is close enough.

Pure functions of metrics.jsonl records, so each verdict is unit-tested without a run.
"""

from __future__ import annotations

import math

WARMUP = 2  # steps dropped from the medians
# FSDP and TP reduce in different orders and TP computes norms and the loss over sharded
# tensors, all in bf16 compute: over the first steps the two agree to ~1e-3; the bounds leave
# room for float8 scales, which see those differences too. grad_norm is the more sensitive.
PARITY_RTOL = {"loss": 2e-2, "grad_norm": 5e-2}
PARITY_STEPS = 3
CKPT_STEP = 3  # resume: checkpoint interval, and the step the rerun resumes from
# A deterministic rerun should be bitwise equal; compiled kernels picked by autotuning may
# not be, so a difference up to this (relative) passes as "not bitwise".
RESUME_RTOL = 1e-3
# The DCP weights are the HF bf16 weights re-saved: step 1 (forward before any update) matches.
SFT_LOSS_RTOL = 1e-3


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger of the two; inf when only one of them is finite."""
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def max_rel_diffs(a: list[dict], b: list[dict], steps: range) -> tuple[dict[str, float], list[int]]:
    """Max relative difference of loss and grad_norm over `steps`, and the steps either lacks."""
    by_a, by_b = ({r["step"]: r for r in rows} for rows in (a, b))
    missing = [s for s in steps if s not in by_a or s not in by_b]
    diffs = {key: max((rel_diff(by_a[s][key], by_b[s][key]) for s in steps if s not in missing),
                      default=0.0) for key in ("loss", "grad_norm")}
    return diffs, missing


def _diffs_text(diffs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())


def parity_verdict(fsdp: list[dict], tp: list[dict]) -> tuple[bool, str]:
    """(pass, note): do the FSDP and TP runs agree over the first PARITY_STEPS steps."""
    diffs, missing = max_rel_diffs(fsdp, tp, range(1, PARITY_STEPS + 1))
    if missing:
        return False, f"steps {missing} missing"
    ok = all(diffs[k] <= PARITY_RTOL[k] for k in diffs)
    return ok, f"max rel diff steps 1-{PARITY_STEPS}: {_diffs_text(diffs)}"


def resume_verdict(reference: list[dict], resumed: list[dict], after: int, last: int) -> tuple[bool, str]:
    """Steps after..last of the resumed run against the uninterrupted reference."""
    steps = range(after + 1, last + 1)
    if not steps:
        return False, f"resumed at step {after}: no steps left to compare"
    diffs, missing = max_rel_diffs(reference, resumed, steps)
    span = f"steps {after + 1}-{last}"
    if missing:
        return False, f"{span}: steps {missing} missing"
    if not any(diffs.values()):
        return True, f"{span} bitwise equal to the reference"
    ok = max(diffs.values()) <= RESUME_RTOL
    return ok, f"{span} not bitwise: max rel diff {_diffs_text(diffs)}"


def check_records(records: list[dict], steps: int) -> str | None:
    """Why a run's metrics are not a pass (None if they are)."""
    last = max((r["step"] for r in records), default=0)
    if last != steps:
        return f"metrics end at step {last} of {steps}"
    bad = [r["step"] for r in records if not math.isfinite(r["loss"])]
    return f"non-finite loss at steps {bad}" if bad else None
