"""The seed comparison of scripts/loss_compare.py: bf16's seed-to-seed spread (the noise band) and each
float8 recipe's gap to bf16 paired by seed, its verdict and its section of loss_compare.md.

The band is bf16's seed-to-seed spread (the sample standard deviation over seeds) of two losses,
the training loss over the last 10 % of steps and the held-out loss averaged over the last
LAST_EVALUATIONS evaluations; a recipe's gap to bf16 is taken per seed (paired: same seed, same
init and data order) in nats, then its mean and spread over the seeds. A mean gap no larger than
the band is "within bf16's seed noise".
"""

from __future__ import annotations

import statistics
from typing import Any

from scripts.harness.cells import BASELINE, PRECISIONS
from scripts.harness.loss.series import baseline_of, relative_gap_pct, tail_mean, validation_of

LAST_EVALUATIONS = 5  # the held-out losses a seed comparison averages


# The losses a seed comparison measures, in the order the verdict prefers them.
SEED_METRICS = ("heldout", "train")


def heldout_tail(run: dict[str, Any]) -> float | None:
    """Mean of the last LAST_EVALUATIONS held-out losses; None without any."""
    val = validation_of(run)
    last = sorted(val)[-LAST_EVALUATIONS:]
    return statistics.fmean(val[s] for s in last) if last else None


def spread(values: list[float]) -> float | None:
    """Sample standard deviation; None under two values."""
    return statistics.stdev(values) if len(values) >= 2 else None


def seed_metric(run: dict[str, Any], metric: str, steps: int) -> float | None:
    if metric == "train":
        return tail_mean(run["train_steps"], run["train_loss"], steps)
    return heldout_tail(run)


def seed_gaps(runs: list[dict[str, Any]], precision: str, metric: str, steps: int) -> dict[str, Any]:
    """The recipe's gaps to bf16 paired by seed: per seed, mean and spread, in nats and %."""
    gaps: dict[str, float] = {}
    pcts: list[float] = []
    for run in runs:
        base = baseline_of(runs, run.get("seed"))
        if run["precision"] != precision or not run["ok"] or run.get("seed") is None or base is None:
            continue
        value, base_value = seed_metric(run, metric, steps), seed_metric(base, metric, steps)
        if value is None or base_value is None:
            continue
        gaps[str(run["seed"])] = value - base_value
        pcts.append(relative_gap_pct(value, base_value))
    values = list(gaps.values())
    return {"per_seed_nats": gaps, "mean_nats": statistics.fmean(values) if values else None,
            "spread_nats": spread(values), "mean_pct": statistics.fmean(pcts) if pcts else None,
            "spread_pct": spread(pcts)}


def seed_summary(runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """bf16's seed-to-seed spread per loss, each float8 recipe's paired gaps and its verdict."""
    seeds = sorted({r["seed"] for r in runs if r.get("seed") is not None})
    bf16 = [r for r in runs if r["precision"] == BASELINE and r["ok"] and r.get("seed") is not None]
    bands = {m: spread([v for r in bf16 if (v := seed_metric(r, m, steps)) is not None]) for m in SEED_METRICS}
    recipes = {}
    for precision in sorted({r["precision"] for r in runs} - {BASELINE}, key=PRECISIONS.index):
        gaps = {m: seed_gaps(runs, precision, m, steps) for m in SEED_METRICS}
        metric = next((m for m in SEED_METRICS if gaps[m]["mean_nats"] is not None), "train")
        recipes[precision] = {"metric": metric, **gaps,
                              "gap_nats": {"mean": gaps[metric]["mean_nats"], "spread": gaps[metric]["spread_nats"]},
                              "gap_pct": {"mean": gaps[metric]["mean_pct"], "spread": gaps[metric]["spread_pct"]}}
    headline = next((m for m in SEED_METRICS if bands[m] is not None), "train")
    return {"seeds": seeds, "bf16_seed_spread_nats": bands[headline], "noise_metric": headline,
            "bf16_seed_spread_by_metric_nats": bands, "recipes": recipes}


METRIC_NAMES = {"heldout": f"held-out loss (mean of the last {LAST_EVALUATIONS} evaluations)",
                "train": "training loss (last 10 % of steps)"}


def _pm(mean: float | None, spread_: float | None, unit: str, digits: int) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:+.{digits}f}" + ("" if spread_ is None else f" ± {spread_:.{digits}f}") + unit


def seed_verdict(precision: str, recipe: dict[str, Any], bands: dict[str, float | None]) -> dict[str, Any]:
    """{"within", "verdict", "text"}: the recipe's mean gap weighed against bf16's seed spread of the same loss."""
    metric = recipe["metric"]
    gap, band = recipe[metric], bands[metric]
    mean = gap["mean_nats"]
    if mean is None:
        return {"within": None, "verdict": None, "text": f"{precision}: no verdict: no run paired with a bf16 run "
                                                          "of the same seed"}
    shown = (f"{METRIC_NAMES[metric]} gap {_pm(mean, gap['spread_nats'], ' nats', 4)} "
             f"({_pm(gap['mean_pct'], gap['spread_pct'], ' %', 2)}) over {len(gap['per_seed_nats'])} seed(s)")
    if band is None:
        return {"within": None, "verdict": None,
                "text": f"{precision}: no noise band (bf16 ran at fewer than 2 seeds): {shown}"}
    if abs(mean) <= band:
        words, within = "within bf16's seed noise", True
    elif mean < 0:
        words, within = f"better by {_pm(-mean, gap['spread_nats'], ' nats', 4).lstrip('+')}", False
    else:
        words, within = f"worse by {_pm(mean, gap['spread_nats'], ' nats', 4).lstrip('+')}", False
    return {"within": within, "verdict": words.split(" by ")[0],
            "text": f"{precision}: {words}: {shown}; bf16's seed spread {band:.4f} nats"}


def render_seeds(report: dict[str, Any]) -> str:
    """The seed comparison: bf16's band and each recipe's paired gaps, per loss; "" without seeds."""
    if not report.get("seeds"):
        return ""
    bands = report["bf16_seed_spread_by_metric_nats"]
    lines = ["## Against bf16's seed noise", "",
             f"Seeds {', '.join(map(str, report['seeds']))}. The band: bf16's seed-to-seed spread (sample "
             "standard deviation over seeds). A gap: the recipe's loss minus bf16's at the same seed (same "
             "init, same data order), then its mean ± spread over the seeds; positive is worse.", "",
             "| recipe | loss | bf16 seed spread (band) | gap (nats) | gap (%) | per seed (nats) |",
             "|---|---|--:|--:|--:|---|"]
    for precision, recipe in report["recipes"].items():
        for metric in SEED_METRICS:
            gap = recipe[metric]
            band = "n/a" if bands[metric] is None else f"{bands[metric]:.4f} nats"
            per_seed = ", ".join(f"{s}: {g:+.4f}" for s, g in gap["per_seed_nats"].items()) or "-"
            lines.append(f"| {precision} | {METRIC_NAMES[metric]} | {band} | "
                         f"{_pm(gap['mean_nats'], gap['spread_nats'], '', 4)} | "
                         f"{_pm(gap['mean_pct'], gap['spread_pct'], '', 2)} | {per_seed} |")
    return "\n".join(lines)

