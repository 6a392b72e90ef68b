"""GPU acceptance check: short real train.py runs, one pass/fail table.

    python scripts/gpu_check.py --nproc 2 --out /tmp/gpu_check                     # every group
    python scripts/gpu_check.py --nproc 1 --out /tmp/gc1 --only layouts,parity,ac  # 1 H200: 4 min
    python scripts/gpu_check.py --nproc 1 --out /tmp/gc2 --only resume,sft         # 1 H200: 5 min
    python scripts/gpu_check.py --device cpu --flavor debug --nproc 2 --out /tmp/gc \\
        --only layouts,parity,resume --precisions bf16,tensorwise --compile none   # CPU smoke test

Groups (--only; default all):
  layouts  FSDP (dp = nproc) and TP (tp = nproc, batch x nproc: same global batch and tokens per
           GPU) x precision (bf16, tensorwise, rowwise, rowwise_gw_hp) x compile (none, block)
  parity   loss and grad_norm of steps 1-3 agree between the FSDP and TP rows (runs them)
  ac       activation checkpointing full and selective, and compile.mode model (tensorwise, FSDP)
  resume   kill one worker (SIGKILL) after the step-3 checkpoint, rerun: steps 4.. must equal an
           uninterrupted deterministic run bitwise; sync and async checkpoints
  sft      random 7B -> HF (convert_weights.py --from random) -> DCP; SFT from each; step-1 losses
Base config configs/7b_fp8.toml (sft: configs/7b_sft_fp8.toml) with --layers layers; arguments
after `--` go to every train.py run. Rows needing more GPUs than --nproc are skipped. Writes, under
--out: gpu_check.md, gpu_check.json, runs/<row>/log.txt (other runs of a row: log-<phase>.txt) and
each run's dump folder; an earlier check's files there move to --out/previous-N/ first. The
table comes last on stdout; exit code 0 iff no row that ran failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from models.llama import LLAMA2_FLAVORS
from scripts.harness.arguments import comma_names
from scripts.harness.cells import (
    COMPILE_MODES,
    PRECISIONS,
    display_command,
    environment,
    option_names,
)
from scripts.harness.gpu_check.checks import CKPT_STEP, PARITY_STEPS, WARMUP
from scripts.harness.gpu_check.report import Row, render_markdown, render_table
from scripts.harness.gpu_check.runs import GROUP_RUNNERS, cell_args
from trainer.cli import ArgParser
from trainer.errors import UserError
from trainer.run_folder import keep_earlier_results

ROOT = Path(__file__).resolve().parents[1]

GROUPS = tuple(GROUP_RUNNERS)  # in the order their rows run
# What a check writes under --out (w/: sft's converted weights); the next check moves them aside.
OUTPUTS = ("gpu_check.md", "gpu_check.json", "runs", "w")


def skip_rows(rows: list[Row], nproc: int, unit: str = "GPUs") -> None:
    """Mark the rows that need more processes than `nproc` skipped, saying how many they need."""
    for row in rows:
        if row.needs > nproc:
            row.result, row.reason = "skipped", f"needs {row.needs} {unit}"


def build_rows(cli: argparse.Namespace, groups: list[str]) -> list[Row]:
    """The rows of `groups`, in GROUPS order (parity on 2+ processes adds the layouts rows)."""
    n, tp = cli.nproc, max(cli.nproc, 2)
    cells = [(p, c) for c in cli.compile for p in cli.precisions]
    compile_mode = "block" if "block" in cli.compile else cli.compile[-1]
    fsdp = f"FSDP {n}"

    def tensorwise(group: str, *names: str) -> list[Row]:
        return [Row(name, group, fsdp, "tensorwise", compile_mode) for name in names]

    rows = {
        "layouts": [Row(f"fsdp-{p}-{c}", "layouts", fsdp, p, c) for p, c in cells]
        + [Row(f"tp-{p}-{c}", "layouts", f"TP {tp}", p, c, needs=2) for p, c in cells],
        "parity": [Row(f"parity-{p}-{c}", "parity", f"FSDP {tp} vs TP {tp}", p, c, needs=2)
                   for p, c in cells],
        "ac": [*tensorwise("ac", "ac-full", "ac-selective"),
               Row("compile-model", "ac", fsdp, "tensorwise", "model")],
        "resume": tensorwise("resume", "resume-sync", "resume-async"),
        "sft": tensorwise("sft", "sft-hf", "sft-dcp"),
    }
    wanted = set(groups)
    if "parity" in wanted and n >= 2:
        wanted.add("layouts")  # parity compares the layouts rows' runs
    return [row for group in GROUPS if group in wanted for row in rows[group]]


def run_all(cli: argparse.Namespace, table: list[Row]) -> dict[str, Any]:
    """Run the rows in table order, printing a line as each one finishes."""
    skip_rows(table, cli.nproc, "GPUs" if cli.device == "cuda" else "processes")
    state: dict[str, Any] = {}
    for i, row in enumerate(table, 1):
        if row.result != "skipped":
            GROUP_RUNNERS[row.group](cli, row, state)
        text = row.result + (f" ({row.reason})" if row.reason else "")
        print(f"[{i}/{len(table)}] {row.name}: {text}, {row.wall_s:.0f} s", flush=True)
    ref = state.get("resume_reference")
    return {"resume_reference": {"command": display_command(ref.cmd), "log": ref.log,
                                 "reason": ref.reason}} if ref else {}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options, with train.py overrides after `--` in .extras; raises UserError."""
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extras = argv[:cut], argv[cut + 1:]
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run (default 1)")
    p.add_argument("--only", default=",".join(GROUPS), help="comma list of groups (default: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--flavor", choices=sorted(LLAMA2_FLAVORS), default="7B")
    p.add_argument("--layers", type=int, default=2, help="model.n_layers of the short runs (default 2)")
    p.add_argument("--steps", type=int, default=6, help=f"steps per run (default 6; {WARMUP} warm-up)")
    p.add_argument("--resume-steps", type=int, default=6, help="steps of the kill/resume runs (default 6)")
    p.add_argument("--batch-size", type=int, help="per FSDP rank (default 2)")
    p.add_argument("--seq-len", type=int, help="default 4096 (debug flavor: 128)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="layouts/parity precisions")
    p.add_argument("--compile", default="none,block", help="layouts/parity compile modes; the other "
                   "rows use block, or the last of these if block is left out")
    p.add_argument("--sft-layers", type=int, help="SFT depth (default: the flavor's with --nproc >= 2, "
                   "else at most 8)")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds per train.py run (default 900)")
    p.add_argument("--keep-files", action="store_true", help="keep checkpoints and converted weights")
    cli = p.parse_args(argv)
    cli.extras = extras
    cli.groups = comma_names(cli.only, GROUPS, "--only")
    cli.precisions = comma_names(cli.precisions, PRECISIONS, "--precisions")
    cli.compile = comma_names(cli.compile, COMPILE_MODES, "--compile")
    if cli.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {cli.nproc}")
    if cli.steps <= max(WARMUP, PARITY_STEPS):
        raise UserError(f"--steps must be > {max(WARMUP, PARITY_STEPS)}, got {cli.steps}")
    if cli.resume_steps <= CKPT_STEP:
        raise UserError(f"--resume-steps must be > {CKPT_STEP}, got {cli.resume_steps}")
    debug = cli.flavor == "debug"
    cli.batch_size = cli.batch_size or 2
    cli.seq_len = cli.seq_len or (128 if debug else 4096)
    full = LLAMA2_FLAVORS[cli.flavor].n_layers
    cli.sft_layers_note = ""
    if cli.sft_layers is None:
        cli.sft_layers = full if cli.nproc >= 2 else min(full, 8)
        if cli.sft_layers < full:
            # The SFT config (batch 2 x 4096, selective AC) is sized for several GPUs.
            cli.sft_layers_note = f" of {full} on one GPU (--sft-layers {full} for all)"
    cli.out = cli.out.resolve()
    owned = set(option_names(cell_args(cli, Path("x"), "rowwise", "none"))) | {
        "config", "training.deterministic", "checkpoint.enable", "checkpoint.interval",
        "checkpoint.async_mode", "checkpoint.initial_load_path", "checkpoint.initial_load_format",
        "checkpoint.export_final", "activation_checkpoint.mode", "model.tokenizer_path"}
    for name in option_names(extras):
        if name in owned - {"float8.fsdp_float8_all_gather"}:
            raise UserError(f"--{name} after `--` is set by this script for each row")
    return cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli = parse_args(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    os.chdir(ROOT)  # the configs name data/ and the tokenizer relative to the repository
    keep_earlier_results(cli.out, OUTPUTS)
    cli.out.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    table = build_rows(cli, cli.groups)
    extra_info = run_all(cli, table)
    info = {"command": shlex.join(["python", "scripts/gpu_check.py", *argv]), "date": date,
            "nproc": cli.nproc, "environment": environment()}
    ok = all(r.result in ("pass", "skipped") for r in table)
    report = {**info, "passed": ok, "groups": cli.groups, "flavor": cli.flavor, "layers": cli.layers,
              "steps": cli.steps, "resume_steps": cli.resume_steps, "batch_size": cli.batch_size,
              "seq_len": cli.seq_len, "sft_layers": cli.sft_layers, "train_overrides": cli.extras,
              **extra_info, "rows": [dataclasses.asdict(r) for r in table]}
    (cli.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (cli.out / "gpu_check.md").write_text(render_markdown(table, info))
    print(f"wrote {cli.out / 'gpu_check.md'}, {cli.out / 'gpu_check.json'}; "
          f"{'all rows passed' if ok else 'FAILED'}", flush=True)
    print(render_table(table), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
