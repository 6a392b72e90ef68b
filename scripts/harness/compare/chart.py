"""The comparison chart: tokens/s per GPU grouped by compile mode, from one run or merged from several.

Merged runs whose cells do not collide (e.g. a compiled run and an eager run) fill one
grid, with speedups over bf16 across the merged cells. Runs that measured the same cell
(e.g. batch 2 and batch 4) keep one group per compile mode and run, labelled by the run,
with speedups within each run.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from scripts.harness.cells import COMPILE_MODES, IMPLS, PRECISIONS
from scripts.harness.compare.report import Run, add_speedups, speedup_text
from scripts.harness.compare.run import CellResult


@dataclasses.dataclass
class ChartData:
    """What the chart draws: x groups, one bar per (precision, group), each with a height and a label;
    a precision is a cell's label (tensorwise, tensorwise-torchao)."""

    groups: list[str]
    precisions: list[str]
    bars: dict[tuple[str, str], tuple[float, str]]
    per_run: bool


def _run_labels(runs: list[Run], labels: list[str] | None) -> list[str]:
    if labels:
        return labels
    # The folder a comparison.json sits in is what its --out was: cmp_b2, cmp_b4, ...
    names = [run.path.parent.name or run.path.stem for run in runs]
    return names if len(set(names)) == len(names) else [f"run {i}" for i in range(1, len(runs) + 1)]


def chart_data(runs: list[Run], labels: list[str] | None = None) -> ChartData:
    """Bars of the merged runs; `labels` name the runs when their cells collide."""
    cells = [(r.label, r.compile) for run in runs for r in run.results]
    per_run = len(cells) != len(set(cells))
    names = _run_labels(runs, labels)
    grouped: list[tuple[str, CellResult]] = []
    for run, name in zip(runs, names):
        results = [dataclasses.replace(r) for r in run.results]
        if per_run:
            add_speedups(results)
        grouped += [(f"compile {r.compile}" + (f", {name}" if per_run else ""), r) for r in results]
    if not per_run:
        add_speedups([r for _, r in grouped])
    first_seen: dict[str, tuple[int, int]] = {}
    for i, (group, r) in enumerate(grouped):
        first_seen.setdefault(group, (COMPILE_MODES.index(r.compile), i))
    groups = sorted(first_seen, key=first_seen.__getitem__)
    # Each recipe's implementations side by side: tensorwise, tensorwise-torchao, rowwise, ...
    order = {r.label: (PRECISIONS.index(r.precision), IMPLS.index(r.impl)) for _, r in grouped}
    precisions = sorted(order, key=order.__getitem__)
    bars = {}
    for group, r in grouped:
        if not r.ok:
            bars[(r.label, group)] = (0.0, "failed")
        elif r.speedup_vs_bf16_same_compile is None:
            bars[(r.label, group)] = (r.tps, "")
        else:
            bars[(r.label, group)] = (r.tps, speedup_text(r.speedup_vs_bf16_same_compile))
    return ChartData(groups, precisions, bars, per_run)


def pyplot_for(path: Path) -> Any:
    """matplotlib.pyplot (headless) to draw `path` with, or None, with a note and no stale chart
    left at `path`, when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: {path.name} not written: matplotlib is not installed "
              "(pip install matplotlib, or pip install -e '.[plot]')", file=sys.stderr)
        path.unlink(missing_ok=True)  # a chart from an earlier run would not match the table
        return None
    return plt


def write_chart(data: ChartData, path: Path, title: str) -> bool:
    """Grouped bars of tokens/s/GPU, one colour per precision, speedups on top; False without matplotlib."""
    plt = pyplot_for(path)
    if plt is None:
        return False
    n = len(data.precisions)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.9 * len(data.groups) * n), 4.5))
    for i, precision in enumerate(data.precisions):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(data.groups))]
        cells = [data.bars.get((precision, g), (0.0, "not run")) for g in data.groups]
        bars = ax.bar(xs, [h for h, _ in cells], width, label=precision, color=f"C{i}")
        ax.bar_label(bars, labels=[label for _, label in cells], padding=2, fontsize=8)
    ax.set_xticks(range(len(data.groups)), data.groups)
    ax.set_ylabel("tokens/s per GPU (median)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    same = "same compile and run" if data.per_run else "same compile"
    # Below the axes: inside, the legend covers the tallest bars and their labels.
    ax.legend(title=f"precision (label: vs bf16, {same})", fontsize=8, title_fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=n)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def chart_title(runs: list[Run]) -> str:
    """Config, processes, device and measured steps of each run; one line per distinct setting."""
    lines = []
    for run in runs:
        info = run.info
        device = (info.get("environment") or {}).get("gpu") or "CPU"
        line = (f"{Path(str(info.get('config', '?'))).name}: {info.get('nproc', '?')} x {device}, "
                f"steps {info.get('warmup', 0) + 1}-{info.get('steps', '?')}")
        if line not in lines:
            lines.append(line)
    return "\n".join(lines)
