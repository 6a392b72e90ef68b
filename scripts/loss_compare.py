"""Is float8 hurting my loss? bf16 and float8 recipes trained side by side, same config, seed and data.

    python scripts/loss_compare.py --config configs/7b_fp8.toml --nproc 8 --out loss/
    python scripts/loss_compare.py --config configs/debug.toml --steps 200 --compile none --out /tmp/loss \\
        -- --training.batch_size 2 --training.seq_len 64 --validation.freq 50
    # a session of limited length: one invocation per recipe, then merged (no runs)
    python scripts/loss_compare.py --config configs/7b_fp8.toml --nproc 8 --precisions bf16 --out loss/bf16
    python scripts/loss_compare.py --config configs/7b_fp8.toml --nproc 8 --precisions tensorwise --out loss/tw
    python scripts/loss_compare.py --merge loss/bf16/loss_compare.json loss/tw/loss_compare.json --out loss/
    # gaps measured against bf16's own seed-to-seed noise: a run per precision x seed
    python scripts/loss_compare.py --config configs/7b_fp8.toml --nproc 8 --seeds 42,43,44 --out loss/

One train.py run per precision (one compile mode, log_freq 1), and per seed with --seeds
(training.seed); arguments after `--` go to every run. Writes, under --out:

    loss_compare.md     per run: final training loss and its gap to bf16 (of the same seed), the
                        worst gap of the moving averages, held-out losses and tokens/s; with several
                        seeds, bf16's seed-to-seed spread (the noise band) and each float8 recipe's
                        gap to bf16 paired by seed, mean ± spread; a verdict per float8 recipe
    loss_compare.json   the same, with every run's loss series, commands, failures and versions
    loss_compare.png    smoothed loss curves and the gap to bf16 with the noise band (several seeds)
                        or the ±tolerance band (one seed) (matplotlib)
    tb/<run>/           each run's TensorBoard events, side by side
    runs/<run>/         each run's dump folder and log.txt (stdout + stderr)

An earlier comparison's files there move to --out/previous-N/ first.
--merge rebuilds the md, json and png from the loss_compare.json of several invocations.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from scripts.harness.arguments import (
    check_config_and_overrides,
    check_run_counts,
    check_train_overrides,
    comma_names,
    invocation,
    split_train_args,
)
from scripts.harness.cells import BASELINE, COMPILE_MODES, PRECISIONS, environment, read_metrics
from scripts.harness.compare.run import CellResult, run_cell
from scripts.harness.loss.chart import write_chart
from scripts.harness.loss.report import (
    DEFAULT_TOLERANCE_PCT,
    PartError,
    build_report,
    health_of,
    load_part,
    render_markdown,
    render_table,
)
from scripts.harness.loss.series import default_window, run_label, series_of
from trainer.cli import ArgParser
from trainer.errors import UserError
from trainer.run_folder import keep_earlier_results

DEFAULT_STEPS = 1000
DEFAULT_COMPILE = "block"
REPORTS = ("loss_compare.md", "loss_compare.json", "loss_compare.png")
OUTPUTS = (*REPORTS, "tb", "runs")
RUN_ONLY = ("--config", "--steps", "--precisions", "--seeds", "--compile", "--nproc", "--warmup")
# What the parts of a merge must share for their losses to be comparable.
SHARED = (("config", "config"), ("steps", "steps"), ("train_overrides", "train overrides after `--`"),
          ("compile", "compile mode"), ("nproc", "nproc"))


def _check_common(cli: argparse.Namespace) -> None:
    if not cli.out:
        raise UserError("the following arguments are required: --out")
    if cli.tolerance is not None and not (math.isfinite(cli.tolerance) and cli.tolerance > 0):
        raise UserError(f"--tolerance must be a positive percentage, got {cli.tolerance}")
    if cli.window is not None and cli.window < 1:
        raise UserError(f"--window must be >= 1, got {cli.window}")


def _check_merge_args(cli: argparse.Namespace, extras: list[str]) -> None:
    given = [flag for flag in RUN_ONLY if getattr(cli, flag[2:]) is not None]
    if given or extras:
        dropped = ", ".join(given + (["the train.py arguments after `--`"] if extras else []))
        raise UserError(f"--merge rebuilds the report from its parts and runs nothing: drop {dropped}")


def _check_run_args(cli: argparse.Namespace, extras: list[str]) -> None:
    if not cli.config:
        raise UserError("the following arguments are required: --config (or --merge PART.json ...)")
    cli.steps = DEFAULT_STEPS if cli.steps is None else cli.steps
    cli.nproc = 1 if cli.nproc is None else cli.nproc
    # `is None`: an empty --precisions (an unset shell variable) is refused, not the default.
    default = "bf16,tensorwise,rowwise"
    cli.precisions = comma_names(default if cli.precisions is None else cli.precisions, PRECISIONS, "--precisions")
    cli.seeds = seed_list(cli.seeds) if cli.seeds is not None else [None]
    if cli.seeds != [None] and "--training.seed" in extras:
        raise UserError("--training.seed is set for each run by --seeds: drop it after `--`")
    cli.compile = DEFAULT_COMPILE if cli.compile is None else cli.compile.strip()
    if cli.compile not in COMPILE_MODES:
        raise UserError(f"--compile takes one mode of {', '.join(COMPILE_MODES)}, got '{cli.compile}'")
    check_run_counts(cli)
    cli.window = default_window(cli.steps) if cli.window is None else cli.window
    if cli.window > cli.steps:
        raise UserError(f"--window must be at most --steps ({cli.steps}), got {cli.window}")
    cli.tolerance = DEFAULT_TOLERANCE_PCT if cli.tolerance is None else cli.tolerance
    cli.profile_step = None  # run_cell's: no step is traced here
    check_config_and_overrides(cli.config, extras, "run", "--precisions, --compile, --steps or --out")


def seed_list(text: str) -> list[int]:
    """The distinct integers of a comma list, in order; raises UserError otherwise."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        seeds = list(dict.fromkeys(int(t) for t in items))
    except ValueError:
        raise UserError(f"--seeds takes a comma list of integers, got '{text}'") from None
    if not seeds:
        raise UserError("--seeds needs at least one integer")
    return seeds


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, train.py overrides after `--`); raises UserError with a one-line message."""
    argv, extras = split_train_args(argv)
    p = ArgParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                  epilog="Arguments after `--` are passed to every train.py run.")
    p.add_argument("--config", help="train.py TOML config (required unless --merge)")
    p.add_argument("--steps", type=int, help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    p.add_argument("--precisions", help=f"comma list of {', '.join(PRECISIONS)} (default bf16,tensorwise,rowwise)")
    p.add_argument("--seeds", help="comma list of training.seed values: a run per precision and seed, gaps "
                                   "measured against bf16's seed-to-seed spread (default: one run, the config's seed)")
    p.add_argument("--compile", help=f"one of {', '.join(COMPILE_MODES)} (default {DEFAULT_COMPILE})")
    p.add_argument("--nproc", type=int, help="processes (GPUs) per run; >1 uses torch.distributed.run (default 1)")
    p.add_argument("--warmup", type=int, help="steps left out of the tokens/s median (default min(3, steps-1))")
    p.add_argument("--window", type=int, help="moving-average window of the worst gap (default max(1, steps // 20))")
    p.add_argument("--tolerance", type=float, help=f"verdict tolerance in %% (default {DEFAULT_TOLERANCE_PCT})")
    p.add_argument("--out", help="output folder (required)")
    p.add_argument("--merge", nargs="+", metavar="PART.json",
                   help="rebuild the report from the loss_compare.json of several invocations (runs nothing)")
    cli = p.parse_args(argv)
    _check_common(cli)
    if cli.merge:
        _check_merge_args(cli, extras)
    else:
        _check_run_args(cli, extras)
    return cli, extras


def merge_parts(parts: list[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The runs of all parts; raises UserError when the parts cannot be compared or overlap."""
    first_path, first = parts[0]
    for path, part in parts[1:]:
        for key, label in SHARED:
            if part[key] != first[key]:
                raise UserError(f"--merge: {first_path} and {path} disagree on {label} "
                              f"({json.dumps(first[key])} vs {json.dumps(part[key])})")
    seen: dict[tuple[str, int | None], Path] = {}
    runs = []
    for path, part in parts:
        for run in part["runs"]:
            key = (run["precision"], run.get("seed"))
            if key in seen:
                raise UserError(f"--merge: {run_label(run)} appears twice ({seen[key]} and {path})")
            seen[key] = path
            runs.append(run)
    if not any(precision == BASELINE for precision, _ in seen):
        raise UserError("--merge: no part has a bf16 run, so there is nothing to compare against")
    return runs


def _agreed(parts: list[tuple[Path, dict[str, Any]]], key: str, default: Any) -> Any:
    values = {json.dumps(part.get(key)) for _, part in parts}
    return parts[0][1].get(key, default) if len(values) == 1 else default


def merge(cli: argparse.Namespace, command: str, date: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(info, runs) of --merge; raises UserError (a part unreadable, or the parts not comparable)."""
    paths = [Path(p) / "loss_compare.json" if Path(p).is_dir() else Path(p) for p in cli.merge]
    try:
        parts = [(path, load_part(path)) for path in paths]
    except PartError as e:
        raise UserError(str(e)) from None
    runs = merge_parts(parts)
    first = parts[0][1]
    base_part = next(part for _, part in parts if any(r["precision"] == BASELINE for r in part["runs"]))
    window = cli.window if cli.window is not None else _agreed(parts, "window", default_window(first["steps"]))
    if window > first["steps"]:
        raise UserError(f"--window must be at most the parts' steps ({first['steps']}), got {window}")
    info = {"command": command, "date": date, "environment": base_part["environment"],
            **{key: first[key] for key, _ in SHARED}, "warmup": _agreed(parts, "warmup", None),
            "window": window, "tolerance": cli.tolerance if cli.tolerance is not None
            else _agreed(parts, "tolerance", DEFAULT_TOLERANCE_PCT),
            "precisions": sorted({r["precision"] for r in runs}, key=PRECISIONS.index),
            "parts": [{"path": str(path), "command": part["command"], "date": part["date"],
                       "environment": part["environment"], "precisions": [run_label(r) for r in part["runs"]]}
                      for path, part in parts]}
    return info, runs


def run_entry(r: CellResult, metrics: Path, warmup: int) -> dict[str, Any]:
    """A run as loss_compare.json keeps it: the cell's result and its series (partial if it failed)."""
    try:
        records = read_metrics(metrics)
    except ValueError:
        records = []
    keep = ("precision", "compile", "ok", "reason", "returncode", "wall_s", "command", "log", "tps",
            "tflops", "peak_memory_gib", "first_step_s", "final_loss", "steps_measured")
    return {"name": r.name, **{k: getattr(r, k) for k in keep}, "seed": r.seed, "warmup": warmup, **series_of(records),
            "health": health_of(records)}


def run_all(cli: argparse.Namespace, extras: list[str], out: Path, train_py: str) -> list[dict[str, Any]]:
    runs = []
    # Evaluations read the whole held-out set unless the user says how many batches.
    run_extras = extras if "--validation.steps" in extras else [*extras, "--validation.steps", "0"]
    # Seed by seed, so that a comparison cut short still holds whole pairs.
    cells = [(seed, precision) for seed in cli.seeds for precision in cli.precisions]
    for i, (seed, precision) in enumerate(cells, 1):
        name = CellResult(precision, cli.compile, seed=seed).name
        tag = f"[{i}/{len(cells)}] {name}"
        print(f"{tag}: running {cli.steps} steps, log in {out / 'runs' / name / 'log.txt'}", flush=True)
        r = run_cell(precision, cli.compile, cli, run_extras, out, train_py, seed=seed)
        status = (f"final loss {r.final_loss:.4f}, {r.tps:,.0f} tokens/s/GPU" if r.ok else f"FAILED: {r.reason}")
        print(f"{tag}: {status} ({r.wall_s or 0:.0f} s)", flush=True)
        runs.append(run_entry(r, out / "runs" / r.name / "metrics.jsonl", cli.warmup))
    return runs


def write_outputs(report: dict[str, Any], out: Path) -> None:
    # Rendered before anything is written: a report that cannot be rendered leaves no half of it.
    markdown = render_markdown(report)
    (out / "loss_compare.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "loss_compare.md").write_text(markdown)
    chart = write_chart(report, out / "loss_compare.png")
    print(f"wrote {out / 'loss_compare.md'}, {out / 'loss_compare.json'}"
          + (f", {out / 'loss_compare.png'}" if chart else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    train_py, command, date = invocation(__file__, argv)
    try:
        cli, extras = parse_args(argv)
        if cli.merge:
            info, runs = merge(cli, command, date)
        else:
            check_train_overrides(cli.config, extras, [(p, cli.compile, None) for p in cli.precisions], cli.steps)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    out = Path(cli.out)
    keep_earlier_results(out, REPORTS if cli.merge else OUTPUTS)
    out.mkdir(parents=True, exist_ok=True)
    if not cli.merge:
        runs = run_all(cli, extras, out, train_py)
        info = {"command": command, "date": date, "environment": environment(), "config": cli.config,
                "steps": cli.steps, "warmup": cli.warmup, "window": cli.window, "tolerance": cli.tolerance,
                "compile": cli.compile, "nproc": cli.nproc, "train_overrides": extras,
                "precisions": cli.precisions}
    report = build_report(info, runs)
    write_outputs(report, out)
    for run in report["runs"]:
        if not run["ok"]:
            print(f"{run['name']} failed: {run['reason']} (log: {run['log']})", flush=True)
    if not any(r["precision"] == BASELINE for r in report["runs"]):
        print("note: no bf16 run here, so no gaps: combine this part with a bf16 one with --merge", flush=True)
    for v in report["verdicts"].values():
        print(v["text"], flush=True)
    print(render_table(report), flush=True)
    return 0 if any(r["ok"] for r in report["runs"]) else 1


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
