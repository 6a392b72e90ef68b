"""loss_compare.png: the smoothed training-loss curves of every run (held-out losses as markers) and,
below, each float8 run's gap to bf16 in %, with the ±tolerance band. Needs matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.cells import PRECISIONS
from scripts.compare_chart import pyplot_for
from scripts.loss_report import baseline_of, moving_average, relative_gap_pct, validation_of


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
    base = baseline_of(report["runs"])
    smooth = {r["name"]: moving_average(r["train_steps"], r["train_loss"], window) for r in runs}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.0, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    for r in runs:
        color = f"C{PRECISIONS.index(r['precision'])}"
        curve = smooth[r["name"]]
        label = r["precision"] + ("" if r["ok"] else " (failed)")
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

    bottom.axhspan(-tolerance, tolerance, color="0.85", label=f"±{tolerance:g} %")
    bottom.axhline(0.0, color="0.4", linewidth=0.8)
    if base is None:
        bottom.text(0.5, 0.5, "no bf16 run: no gaps", transform=bottom.transAxes, ha="center", va="center")
    else:
        ref = smooth[base["name"]]
        for r in runs:
            if r is base:
                continue
            curve = smooth[r["name"]]
            steps = sorted(curve.keys() & ref.keys())
            gaps = [relative_gap_pct(curve[s], ref[s]) for s in steps]
            bottom.plot(steps, [g if g is not None else float("nan") for g in gaps],
                        color=f"C{PRECISIONS.index(r['precision'])}", label=r["precision"], linewidth=1.2)
    bottom.set_ylabel("gap to bf16 (%)")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
