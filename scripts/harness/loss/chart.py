"""loss_compare.png: the smoothed training-loss curves of every run (held-out losses as markers) and,
below, each float8 run's gap to the bf16 run of its seed in %, with bf16's seed-to-seed spread as
the band (several seeds) or the ±tolerance band (one seed). Needs matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.harness.cells import PRECISIONS
from scripts.harness.compare.chart import pyplot_for
from scripts.harness.loss.seeds import METRIC_NAMES, seed_metric
from scripts.harness.loss.series import baseline_of, moving_average, relative_gap_pct, validation_of


def _title(report: dict[str, Any]) -> str:
    env = report["environment"]
    device = env.get("gpu") or "CPU"
    return (f"{Path(str(report['config'])).name}: {report['nproc']} x {device}, {report['steps']} steps, "
            f"compile {report['compile']}")


def write_chart(report: dict[str, Any], path: Path) -> bool:
    """Draw the two panels into `path`; False (with a note, and no stale chart left) without matplotlib."""
    plt = pyplot_for(path)
    if plt is None:
        return False
    window, tolerance = report["window"], report["tolerance"]
    runs = [r for r in report["runs"] if r["train_steps"]]
    bases = {r.get("seed"): baseline_of(report["runs"], r.get("seed")) for r in runs}
    smooth = {r["name"]: moving_average(r["train_steps"], r["train_loss"], window) for r in runs}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.0, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    labelled = set()
    for r in runs:
        color = f"C{PRECISIONS.index(r['precision'])}"
        curve = smooth[r["name"]]
        label = None if r["precision"] in labelled else r["precision"] + ("" if r["ok"] else " (failed)")
        labelled.add(r["precision"])
        top.plot(list(curve), list(curve.values()), color=color, label=label, linewidth=1.2)
        val = validation_of(r)
        if val:
            top.plot(list(val), list(val.values()), "o", color=color, markersize=5,
                     markeredgecolor="black", markeredgewidth=0.5)
    top.set_ylabel(f"training loss (moving average, window {window})")
    top.set_title(_title(report) + "\nmarkers: held-out loss", fontsize=10)
    if runs:
        top.legend(fontsize=8)
    top.grid(alpha=0.3)

    band, metric = report.get("bf16_seed_spread_nats"), report.get("noise_metric")
    bf16_level = [v for r in report["runs"] if r["precision"] == "bf16" and r["ok"] and r.get("seed") is not None
                  and (v := seed_metric(r, metric, report["steps"])) is not None] if band is not None else []
    if bf16_level:
        # The band in % of bf16's loss, so that it reads on the same axis as the gaps.
        band_pct = 100.0 * band / (sum(bf16_level) / len(bf16_level))
        bottom.axhspan(-band_pct, band_pct, color="0.85",
                       label=f"bf16 seed spread, {METRIC_NAMES[metric].split(' (')[0]} (±{band_pct:.2f} %)")
    else:
        bottom.axhspan(-tolerance, tolerance, color="0.85", label=f"±{tolerance:g} %")
    bottom.axhline(0.0, color="0.4", linewidth=0.8)
    paired = [r for r in runs if r["precision"] != "bf16" and bases[r.get("seed")] is not None]
    if not paired:
        bottom.text(0.5, 0.5, "no bf16 run: no gaps", transform=bottom.transAxes, ha="center", va="center")
    labelled = set()
    for r in paired:
        ref, curve = smooth[bases[r.get("seed")]["name"]], smooth[r["name"]]
        steps = sorted(curve.keys() & ref.keys())
        gaps = [relative_gap_pct(curve[s], ref[s]) for s in steps]
        color = f"C{PRECISIONS.index(r['precision'])}"
        bottom.plot(steps, [g if g is not None else float("nan") for g in gaps], color=color, linewidth=1.0,
                    label=None if r["precision"] in labelled else r["precision"])
        labelled.add(r["precision"])
        base_val, val = validation_of(bases[r.get("seed")]), validation_of(r)
        held = sorted(val.keys() & base_val.keys())
        bottom.plot(held, [relative_gap_pct(val[s], base_val[s]) for s in held], "o", color=color, markersize=4,
                    markeredgecolor="black", markeredgewidth=0.5)
    bottom.set_ylabel("gap to bf16 (%)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
