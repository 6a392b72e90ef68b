"""Throughput of bf16 and the float8 recipes, eager and compiled: one train.py run per cell.

    python scripts/compare_throughput.py --config configs/7b_fp8.toml --nproc 8 --out cmp
    python scripts/compare_throughput.py --config configs/7b_fp8.toml --nproc 8 --impls ours,torchao \\
        --precisions bf16,tensorwise --compile block --out cmp  # ours vs torchao.float8, same trainer
    python scripts/compare_throughput.py --config configs/debug.toml --steps 6 --out /tmp/cmp \\
        -- --training.batch_size 2 --training.seq_len 128
    python scripts/compare_throughput.py --config configs/7b_fp8.toml --nproc 2 --steps 10 \\
        --profile-step 8 --out cmp                       # plus a profile summary per cell
    python scripts/compare_throughput.py --chart chart.png cmp_b2/comparison.json cmp_b4/comparison.json

Every cell (precision x compile mode, and for float8 x implementation: --impls) runs train.py
with the same config, seed and data; a torchao cell is named <recipe>-torchao-<compile mode>
(tensorwise-torchao-block), bf16 cells are run once; arguments after `--` go to every run.
Medians are taken after dropping the warm-up steps, so compilation shows up only in the
first-step time. Writes, under --out:

    comparison.md      the table, with the command, date, torch version and device
    comparison.json    the same numbers, versions, per-cell commands and failure reasons
    comparison.png     tokens/s grouped by compile mode (needs matplotlib)
    tb/<cell>/         each run's TensorBoard events, side by side
    runs/<cell>/       each run's dump folder and log.txt (stdout + stderr)

An earlier comparison's files there move to --out/previous-N/ first, as train.py keeps an
earlier run's records.

--chart draws the chart alone from one or more comparison.json files, merging their cells.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.harness.arguments import (
    check_config_and_overrides,
    check_run_counts,
    check_train_overrides,
    comma_names,
    invocation,
    split_train_args,
)
from scripts.harness.cells import (
    BASELINE,
    COMPILE_MODES,
    DEFAULT_IMPL,
    IMPLS,
    PRECISIONS,
    environment,
    option_names,
    precision_label,
)
from scripts.harness.compare.chart import chart_data, chart_title, write_chart
from scripts.harness.compare.report import (
    ResultFileError,
    Run,
    add_speedups,
    load_run,
    render_failures,
    render_markdown,
    render_profiles,
    render_table,
    report_json,
)
from scripts.harness.compare.run import run_cell
from trainer.cli import ArgParser
from trainer.errors import UserError
from trainer.run_folder import keep_earlier_results

DEFAULT_STEPS = 20
# What a comparison writes under --out (run_cell: runs/, tb/); the next comparison moves them aside.
OUTPUTS = ("comparison.md", "comparison.json", "comparison.png", "tb", "runs")


def _check_chart_args(cli: argparse.Namespace) -> None:
    if not cli.results:
        raise UserError("--chart needs at least one comparison.json to draw from")
    if cli.config or cli.out or cli.profile_step is not None:
        raise UserError("--chart draws from result files and runs nothing: drop --config, --out and --profile-step")
    if cli.labels is not None:
        cli.labels = [s.strip() for s in cli.labels.split(",")]
        if len(cli.labels) != len(cli.results) or not all(cli.labels) or len(set(cli.labels)) != len(cli.labels):
            raise UserError(f"--labels needs {len(cli.results)} distinct non-empty names, one per result file")


def _check_run_args(cli: argparse.Namespace, extras: list[str]) -> None:
    if cli.results or cli.labels is not None or cli.title is not None:
        raise UserError("result files, --labels and --title are read only with --chart")
    missing = [name for name, value in (("--config", cli.config), ("--out", cli.out)) if not value]
    if missing:
        raise UserError(f"the following arguments are required: {', '.join(missing)} (or --chart PNG RESULT.json ...)")
    cli.precisions = comma_names(cli.precisions, PRECISIONS, "--precisions")
    cli.compile = comma_names(cli.compile, COMPILE_MODES, "--compile")
    cli.impls = comma_names(cli.impls, IMPLS, "--impls")
    check_run_counts(cli)
    if cli.profile_step is not None and not (
        1 <= cli.profile_step <= cli.steps and set(range(cli.warmup + 1, cli.steps + 1)) - {cli.profile_step}
    ):
        raise UserError(f"--profile-step must be a step in [1, {cli.steps}] that leaves a measured step after "
                      f"the {cli.warmup} warm-up steps, got {cli.profile_step}")
    check_config_and_overrides(cli.config, extras, "cell", "--precisions, --compile, --steps, --profile-step or --out")
    if "float8.impl" in option_names(extras):
        raise UserError("--float8.impl is set for each cell by this script; use --impls")


def run_cells(cli: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(precision, compile mode, float8 impl) of every cell, in table order: per compile mode, each
    precision with its implementations side by side; bf16 once."""
    return [(p, m, impl) for m in cli.compile for p in cli.precisions
            for impl in ([DEFAULT_IMPL] if p == BASELINE else cli.impls)]


def reference_version(cli: argparse.Namespace) -> str | None:
    """torchao's version when a cell runs it, checked before any cell starts; raises UserError without it."""
    if not any(impl == "torchao" for _, _, impl in run_cells(cli)):
        return None
    # Here, not at the top: the parent process loads torch only when a cell runs torchao.
    from trainer.float8_seam.reference import ReferenceMissing, torchao_version

    try:
        return torchao_version("--impls torchao")
    except ReferenceMissing as e:
        raise UserError(str(e)) from None


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, train.py overrides after `--`); raises UserError with a one-line message."""
    argv, extras = split_train_args(argv)
    p = ArgParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Arguments after `--` are passed to every train.py run.")
    p.add_argument("--config", help="train.py TOML config (required unless --chart)")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run; >1 uses torch.distributed.run")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=None, help="steps dropped before the medians (default min(3, steps-1))")
    p.add_argument("--precisions", default="bf16,tensorwise,rowwise", help=f"comma list of {', '.join(PRECISIONS)} (default %(default)s)")
    p.add_argument("--compile", default="none,block,model", help=f"comma list of {', '.join(COMPILE_MODES)} (default %(default)s)")
    p.add_argument("--impls", default=DEFAULT_IMPL,
                   help=f"comma list of float8 implementations, {', '.join(IMPLS)} (torchao: pip install -e "
                        "'.[reference]'), each run for every float8 precision (default %(default)s)")
    p.add_argument("--profile-step", type=int, default=None, metavar="N",
                   help="trace step N of each run (torch.profiler) and add its summary by kernel class; "
                        "the traced step and the one after it (whose period the profiler's stop shortens) are left "
                        "out of the medians")
    p.add_argument("--out", help="output folder (required unless --chart)")
    p.add_argument("--chart", metavar="PNG", help="only draw the chart, from the comparison.json files given")
    p.add_argument("--labels", help="with --chart: comma list naming each result file (default: its folder)")
    p.add_argument("--title", help="with --chart: the chart's title (default: config, GPUs and steps of each run)")
    p.add_argument("results", nargs="*", metavar="RESULT.json", help="with --chart: comparison.json files to merge")
    cli = p.parse_args(argv)
    if cli.chart:
        _check_chart_args(cli)
    else:
        _check_run_args(cli, extras)
    return cli, extras


def draw_from_files(cli: argparse.Namespace) -> int:
    """--chart: the chart of one or more earlier comparisons, cells merged."""
    try:
        runs = [load_run(Path(p)) for p in cli.results]
    except ResultFileError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    data = chart_data(runs, cli.labels)
    if not write_chart(data, Path(cli.chart), cli.title or chart_title(runs)):
        return 1
    print(f"wrote {cli.chart}: {len(data.bars)} cells from {len(runs)} result file(s); "
          f"groups: {'; '.join(data.groups)}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli, extras = parse_args(argv)
        if cli.chart:
            return draw_from_files(cli)
        check_train_overrides(cli.config, extras, run_cells(cli), cli.steps, cli.profile_step)
        torchao = reference_version(cli)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    out = Path(cli.out)
    keep_earlier_results(out, OUTPUTS)
    out.mkdir(parents=True, exist_ok=True)
    train_py, command, date = invocation(__file__, argv)

    cells = run_cells(cli)
    results = []
    for i, (precision, mode, impl) in enumerate(cells, 1):
        name = f"{precision_label(precision, impl)}-{mode}"
        tag = f"[{i}/{len(cells)}] {name}"
        print(f"{tag}: running, log in {out / 'runs' / name / 'log.txt'}", flush=True)
        r = run_cell(precision, mode, cli, extras, out, train_py, impl)
        status = f"{r.tps:,.0f} tokens/s/GPU" if r.ok else f"FAILED: {r.reason}"
        print(f"{tag}: {status} ({r.wall_s:.0f} s)", flush=True)
        results.append(r)
    add_speedups(results)

    info = {"command": command, "date": date, "nproc": cli.nproc, "steps": cli.steps, "warmup": cli.warmup,
            "profile_step": cli.profile_step, "environment": environment(), "config": cli.config,
            "train_overrides": extras, "precisions": cli.precisions, "compile_modes": cli.compile,
            "impls": cli.impls, "torchao": torchao}
    # Rendered before anything is written: a report that cannot be rendered leaves no half of it.
    markdown = render_markdown(results, info)
    (out / "comparison.json").write_text(json.dumps(report_json(results, info), indent=2) + "\n")
    (out / "comparison.md").write_text(markdown)
    run = Run(out / "comparison.json", results, info)
    chart = write_chart(chart_data([run]), out / "comparison.png", chart_title([run]))
    print(f"wrote {out / 'comparison.md'}, {out / 'comparison.json'}"
          + (f", {out / 'comparison.png'}" if chart else "") + f", {out / 'tb'}/", flush=True)
    if cli.profile_step is not None:
        print(render_profiles(results, cli.profile_step) + "\n")
    failures = render_failures(results)
    if failures:
        print(failures)
    print(render_table(results), flush=True)
    return 0 if any(r.ok for r in results) else 1


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
