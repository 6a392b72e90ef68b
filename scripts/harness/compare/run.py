"""Running one comparison cell: its train.py run, its metrics, its TensorBoard files and profile.

Used by scripts/compare_throughput.py and scripts/loss_compare.py; the running and parsing itself is
cells.py's. report.py turns the CellResults into tables and chart.py into the chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from scripts.harness.cells import (
    DEFAULT_IMPL,
    cell_overrides,
    display_command,
    failure_reason,
    precision_label,
    read_metrics,
    run_logged,
    summarize_metrics,
    train_launcher,
)
from scripts.harness.traces import TraceError, load_trace
from scripts.harness.traces import summarize as summarize_trace


@dataclasses.dataclass
class CellResult:
    """One precision x compile-mode run (of one float8 implementation); metric fields stay None when
    the run failed."""

    precision: str
    compile: str
    # float8.impl of a float8 cell: ours, or the reference library (torchao); bf16 cells keep ours.
    impl: str = DEFAULT_IMPL
    # training.seed when the comparison sets one per run (loss_compare --seeds); None: the config's.
    seed: int | None = None
    ok: bool = False
    reason: str | None = None
    returncode: int | None = None
    wall_s: float | None = None
    command: str = ""
    log: str = ""
    tps: float | None = None
    tflops: float | None = None
    mfu_pct: float | None = None
    peak_memory_gib: float | None = None
    first_step_s: float | None = None
    final_loss: float | None = None
    steps_measured: int | None = None
    speedup_vs_bf16_eager: float | None = None
    speedup_vs_bf16_same_compile: float | None = None
    # traces.py's summary of the profiled step (rank 0), or {"error": ...}.
    profile: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        """The precision with its float8 implementation unless ours: tensorwise, tensorwise-torchao."""
        return precision_label(self.precision, self.impl)

    @property
    def name(self) -> str:
        return f"{self.label}-{self.compile}" + ("" if self.seed is None else f"-seed{self.seed}")


def copy_events(src: Path, dst: Path) -> None:
    """Copy a run's TensorBoard files, dropping the hostname that event file names carry."""
    if not src.is_dir():
        return
    host = socket.gethostname()
    for f in src.rglob("*"):
        if f.is_file():
            target = dst / f.relative_to(src).parent / f.name.replace(f".{host}.", ".host.")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, target)


def profile_of(run_dir: Path, step: int) -> dict[str, Any]:
    """Summary of rank 0's trace of `step`, or {"error": reason} when there is none to read."""
    try:
        return summarize_trace(load_trace(run_dir / "profiles" / f"step-{step}" / "rank-0.json"))
    except TraceError as e:
        return {"error": str(e)}


def run_cell(precision: str, compile_mode: str, cli: argparse.Namespace, extras: list[str],
             out: Path, train_py: str, impl: str = DEFAULT_IMPL, seed: int | None = None) -> CellResult:
    """One cell's train.py run, dumping to a new out/runs/<cell>/ with its TensorBoard files under out/tb/;
    `seed` sets training.seed (and names the run)."""
    result = CellResult(precision, compile_mode, impl, seed)
    run_dir = out / "runs" / result.name
    tb_dir = out / "tb" / result.name
    run_dir.mkdir(parents=True)  # compare_throughput moved an earlier comparison's runs/ aside
    seeded = [] if seed is None else ["--training.seed", str(seed), "--job.run_name", result.name]
    cmd = [*train_launcher(cli.nproc, train_py), "--config", cli.config, *extras,
           *cell_overrides(precision, compile_mode, cli.steps, str(run_dir), cli.profile_step, impl), *seeded]
    result.command = display_command(cmd)
    result.log = str(run_dir / "log.txt")
    start = time.perf_counter()
    rc, stderr_tail = run_logged(cmd, run_dir / "log.txt")
    result.wall_s = time.perf_counter() - start
    result.returncode = rc
    copy_events(run_dir / "tb" / result.name, tb_dir)
    if rc != 0:
        result.reason = failure_reason(stderr_tail, rc)
        return result
    # The traced step runs slower, and the profiler's stop waits for the device, so the period of the
    # step after it misses the update before it.
    profiled = frozenset() if cli.profile_step is None else frozenset({cli.profile_step, cli.profile_step + 1})
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
        last = max((r["step"] for r in records), default=0)
        if last != cli.steps:
            raise ValueError(f"train.py exited 0 after {last} of {cli.steps} steps")
        for key, value in summarize_metrics(records, cli.warmup, profiled).items():
            setattr(result, key, value)
        result.ok = True
    except (ValueError, KeyError) as e:
        result.reason = f"unusable metrics: {e}"
    if cli.profile_step is not None:
        result.profile = profile_of(run_dir, cli.profile_step)
    return result
