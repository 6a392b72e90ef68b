"""Step time and peak memory of each activation checkpointing mode, eager and compiled per block.

    python scripts/bench_ac.py                      # one H200: the 7B config cut to 4 layers, batch 8 x 4096
    python scripts/bench_ac.py --flavor debug --n-layers 2 --batch-size 2 --seq-len 128 --steps 2  # CPU smoke

One train.py run per cell (precision x compile mode x AC mode), all from --config with the
same seed and data; arguments after `--` go to every run. Step time: median of the steps
after the first (which compiles); memory: `memory/peak_active_gib` of the last step (CUDA
active bytes; on CPU it is the process's peak RSS, which says little about activations).
Each row also gives memory and time relative to the same precision and compile mode
without AC, and the last loss (AC must not change it beyond float noise). An earlier
benchmark's results in --out move to --out/previous-N/ first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path

from scripts.harness.arguments import comma_names
from scripts.harness.cells import (
    COMPILE_MODES,
    PRECISIONS,
    cell_overrides,
    failure_reason,
    read_metrics,
    run_logged,
    train_launcher,
)
from trainer.cli import ArgParser
from trainer.config import ActivationCheckpointMode
from trainer.errors import UserError
from trainer.run_folder import keep_earlier_results

ROOT = Path(__file__).resolve().parents[1]

AC_MODES = typing.get_args(ActivationCheckpointMode)
# Every cell folder a benchmark can leave in --out, whatever its lists were, and its results.
OUTPUTS = ("results.json", *("-".join(cell) for cell in itertools.product(PRECISIONS, COMPILE_MODES, AC_MODES)))


def cell_args(a: argparse.Namespace, precision: str, compile_mode: str, ac: str, dump: Path) -> list[str]:
    """train.py options of one cell; the arguments after `--` come last, so they win."""
    return [
        "--config", a.config, "--model.flavor", a.flavor, "--model.n_layers", str(a.n_layers),
        "--training.batch_size", str(a.batch_size), "--training.seq_len", str(a.seq_len),
        "--activation_checkpoint.mode", ac, *cell_overrides(precision, compile_mode, a.steps, str(dump)),
        "--metrics.enable_tensorboard", "false", *a.extra,
    ]


def run_cell(a: argparse.Namespace, precision: str, compile_mode: str, ac: str) -> dict:
    """One train.py run, logged to <dump>/log.txt; its step time, peak memory and last loss."""
    dump = Path(a.out) / f"{precision}-{compile_mode}-{ac}"
    dump.mkdir(parents=True, exist_ok=True)
    cmd = [*train_launcher(1, "train.py"), *cell_args(a, precision, compile_mode, ac, dump)]
    cell = {"precision": precision, "compile": compile_mode, "ac": ac, "ok": False}
    start = time.perf_counter()
    try:
        rc, stderr_tail = run_logged(cmd, dump / "log.txt", timeout=a.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {**cell, "reason": f"timed out after {a.timeout} s"}
    cell["wall_s"] = time.perf_counter() - start
    if rc != 0:
        return {**cell, "reason": failure_reason(stderr_tail, rc)}
    try:
        rows = sorted(read_metrics(dump / "metrics.jsonl"), key=lambda r: r["step"])
    except ValueError as e:
        return {**cell, "reason": str(e)}
    timed = [r for r in rows if r["step"] > 1] or rows
    return {
        **cell, "ok": True,
        "step_ms": 1000 * statistics.median(r["step_time_s"] for r in timed),
        "peak_gib": rows[-1].get("memory/peak_active_gib"),
        "loss": rows[-1]["loss"],
    }


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def render(cells: list[dict]) -> str:
    base = {(c["precision"], c["compile"]): c for c in cells if c["ok"] and c["ac"] == "none"}
    out = [
        "| precision | compile | AC | step ms | peak GiB | memory vs no AC | time vs no AC | last loss |",
        "|---|---|---|--:|--:|--:|--:|--:|",
    ]
    for c in cells:
        head = f"| {c['precision']} | {c['compile']} | {c['ac']} |"
        if not c["ok"]:
            out.append(f"{head} failed: {c['reason'][:80]} | | | | |")
            continue
        b = base.get((c["precision"], c["compile"]))
        mem = c["peak_gib"] / b["peak_gib"] if b and c["peak_gib"] and b["peak_gib"] else None
        t = c["step_ms"] / b["step_ms"] if b else None
        out.append(
            f"{head} {c['step_ms']:.0f} | {_fmt(c['peak_gib'], '.2f')} | {_fmt(mem, '.2f')}x "
            f"| {_fmt(t, '.2f')}x | {c['loss']:.4f} |"
        )
    return "\n".join(out)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options (.argv: those before `--`; .extra: the train.py overrides after it); raises UserError."""
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:cut], argv[cut + 1:]
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/7b_fp8.toml")
    p.add_argument("--flavor", default="7B")
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--precisions", default="bf16,tensorwise", help="bf16 and/or float8 scalings")
    p.add_argument("--compile", default="none,block", help="compile modes")
    p.add_argument("--ac", default="none,full,selective", help="activation checkpointing modes")
    p.add_argument("--out", default=None, help="dump folders, logs and results.json (default: a temp dir)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    a = p.parse_args(argv)
    a.argv, a.extra = argv, extra
    a.precisions = comma_names(a.precisions, PRECISIONS, "--precisions")
    a.compile = comma_names(a.compile, COMPILE_MODES, "--compile")
    a.ac = comma_names(a.ac, AC_MODES, "--ac")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        a = parse_args(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if not a.out:
        a.out = tempfile.mkdtemp(prefix="bench_ac_")
    else:
        keep_earlier_results(Path(a.out), OUTPUTS)
    cells = []
    for precision, compile_mode, ac in itertools.product(a.precisions, a.compile, a.ac):
        cell = run_cell(a, precision, compile_mode, ac)
        cells.append(cell)
        status = f"{cell['step_ms']:.0f} ms" if cell["ok"] else f"failed: {cell['reason']}"
        print(f"{precision} compile={compile_mode} ac={ac}: {status}", flush=True)
    (Path(a.out) / "results.json").write_text(json.dumps({"argv": a.argv, "extra": a.extra, "cells": cells}, indent=1))
    import torch

    print(f"\ntorch {torch.__version__}, {a.flavor} x {a.n_layers} layers, batch {a.batch_size} x seq "
          f"{a.seq_len}, {a.steps} steps; logs in {a.out}\n")
    print(render(cells))
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
