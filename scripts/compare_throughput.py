"""Throughput of bf16 and the float8 recipes, eager and compiled: one train.py run per cell.

    python scripts/compare_throughput.py --config configs/7b_fp8.toml --nproc 8
    python scripts/compare_throughput.py --config configs/debug.toml --steps 6 --out /tmp/cmp \\
        -- --training.batch_size 2 --training.seq_len 128

Every cell (precision x compile mode) runs train.py with the same config, seed and data;
arguments after `--` go to every run. Medians are taken after dropping the warm-up steps,
so compilation shows up only in the first-step time. Writes, under --out:

    comparison.md      the table, with the command, date, torch version and device
    comparison.json    the same numbers, versions, per-cell commands and failure reasons
    comparison.png     tokens/s grouped by compile mode (needs matplotlib)
    tb/<cell>/         each run's TensorBoard events, side by side
    runs/<cell>/       each run's dump folder and log.txt (stdout + stderr)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PRECISIONS = ("bf16", "tensorwise", "rowwise", "rowwise_gw_hp")
COMPILE_MODES = ("none", "block", "model")
BASELINE = "bf16"
DEFAULT_STEPS = 20


@dataclasses.dataclass
class CellResult:
    """One precision x compile-mode run; metric fields stay None when the run failed."""

    precision: str
    compile: str
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

    @property
    def name(self) -> str:
        return f"{self.precision}-{self.compile}"


# -- pure helpers (unit-tested without subprocesses) -----------------------------------------


def cell_overrides(precision: str, compile_mode: str, steps: int, dump_folder: str) -> list[str]:
    """train.py options that define a cell; they come after the user's, so they win."""
    name = f"{precision}-{compile_mode}"
    args = ["--float8.enabled", "false" if precision == BASELINE else "true"]
    if precision != BASELINE:
        args += ["--float8.scaling", precision]
    if precision != "tensorwise":
        # float8 all-gather exists for tensorwise only; a config that turns it on (7b_fp8.toml)
        # must not carry it into the other cells, where the advisor would flag it.
        args += ["--float8.fsdp_float8_all_gather", "false"]
    return [
        *args,
        "--compile.mode", compile_mode,
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "true",
        "--job.dump_folder", dump_folder,
        "--job.run_name", name,
        "--checkpoint.enable", "false",
        "--profiling.enable", "false",
    ]


def _option_names(args: list[str]) -> list[str]:
    return [a[2:].partition("=")[0] for a in args if a.startswith("--")]


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Per-cell numbers from metrics.jsonl records (log_freq 1); raises ValueError if unusable."""
    records = sorted(records, key=lambda r: r["step"])
    measured = [r for r in records if r["step"] > warmup]
    if not measured:
        raise ValueError(f"metrics.jsonl has no steps after the {warmup} warm-up steps")
    mfu = [r["mfu_pct"] for r in measured if r.get("mfu_pct") is not None]
    first = [r["step_time_s"] for r in records if r["step"] == 1]
    return {
        "tps": statistics.median(r["tps"] for r in measured),
        "tflops": statistics.median(r["tflops"] for r in measured),
        "mfu_pct": statistics.median(mfu) if mfu else None,
        "peak_memory_gib": max(r["memory/peak_active_gib"] for r in records),
        "first_step_s": first[0] if first else None,
        "final_loss": records[-1]["loss"],
        "steps_measured": len(measured),
    }


def add_speedups(results: list[CellResult]) -> None:
    """Tokens/s relative to bf16 eager and to bf16 under the same compile mode (None if missing)."""
    bf16 = {r.compile: r.tps for r in results if r.ok and r.precision == BASELINE}
    for r in results:
        if not r.ok:
            continue
        eager, same = bf16.get("none"), bf16.get(r.compile)
        r.speedup_vs_bf16_eager = r.tps / eager if eager else None
        r.speedup_vs_bf16_same_compile = r.tps / same if same else None


_PREFIX = re.compile(r"^\[(?:rank|default)?\d+\]: ?")
_NOISE = re.compile(r"^(?:warning:|[=\-*]{3,}|[WI]\d{4} |\[W\d|\S*Warning:|\s)")
# torchrun's own exception after a worker failed names no cause; the worker's line does.
_LAUNCHER = "ChildFailedError"


def failure_reason(stderr_lines: list[str], returncode: int) -> str:
    """The last meaningful stderr line: a user error or an exception, else any non-noise line."""
    lines = [_PREFIX.sub("", line).rstrip() for line in stderr_lines]
    found = []
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            # The first unindented line after the frames is "package.ExceptionType: message".
            in_traceback = False
            found.append(line)
        elif line.startswith("error:"):
            found.append(line)
    found = [line for line in found if _LAUNCHER not in line]
    if found:
        return found[-1]
    for line in reversed(lines):
        if line and not _NOISE.match(line):
            return line
    if returncode < 0:
        return f"killed by signal {-returncode}" + (" (out of host memory?)" if returncode == -9 else "")
    return f"exit code {returncode}"


def _num(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _opt(x: float | None, fmt: Any = _num) -> str:
    return "n/a" if x is None else fmt(x)


def _speedup(x: float) -> str:
    return f"{x:.2f}x"


TABLE_HEADER = (
    "| precision | compile | tokens/s/GPU | TFLOP/s/GPU | MFU % | peak mem GiB | first step s "
    "| final loss | vs bf16 eager | vs bf16 same compile |\n"
    "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"
)


def render_table(results: list[CellResult]) -> str:
    rows = [TABLE_HEADER]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.precision} | {r.compile} | failed | | | | | | | |")
            continue
        rows.append(
            f"| {r.precision} | {r.compile} | {r.tps:,.0f} | {_num(r.tflops)} | {_opt(r.mfu_pct)} "
            f"| {_num(r.peak_memory_gib)} | {_opt(r.first_step_s)} | {r.final_loss:.4f} "
            f"| {_opt(r.speedup_vs_bf16_eager, _speedup)} | {_opt(r.speedup_vs_bf16_same_compile, _speedup)} |"
        )
    return "\n".join(rows)


def render_failures(results: list[CellResult]) -> str:
    failed = [r for r in results if not r.ok]
    if not failed:
        return ""
    return "Failed cells:\n" + "\n".join(f"- {r.name}: {r.reason} (log: {r.log})" for r in failed)


def render_markdown(results: list[CellResult], info: dict[str, Any]) -> str:
    steps, warmup = info["steps"], info["warmup"]
    env = info["environment"]
    device = env["gpu"] or f"CPU ({env['cpu']})"
    memory = "peak active CUDA memory" if env["gpu"] else "process peak RSS (CPU run)"
    parts = ["# Throughput: bf16 vs float8, eager vs compiled", "", render_table(results), ""]
    if failures := render_failures(results):
        parts += [failures, ""]
    parts += [
        f"Medians over steps {warmup + 1}-{steps} of {steps} ({warmup} warm-up steps dropped); "
        f"first step s includes compilation; peak mem is the max over all steps of the {memory}; "
        "MFU is against the GPU's bf16 dense peak (n/a on CPU)."
        + ("" if env["gpu"] else " On a CPU without native bf16 the bf16 cells compute in float32 "
           "(training.mixed_precision_param = auto)."),
        "",
        f"- command: `{info['command']}`",
        f"- date: {info['date']}",
        f"- torch {env['torch']}" + (f", CUDA {env['cuda']}" if env["cuda"] else "") + f", python {env['python']}",
        f"- device: {device} x {info['nproc']} process(es)",
    ]
    return "\n".join(parts) + "\n"


# -- running the cells ---------------------------------------------------------------------------


def _launcher(nproc: int, train_py: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, train_py]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", train_py]


def _display(cmd: list[str]) -> str:
    return shlex.join(["python", *cmd[1:]]) if cmd[0] == sys.executable else shlex.join(cmd)


def _stream(cmd: list[str], log_path: Path) -> tuple[int, list[str]]:
    """Run cmd, writing stdout and stderr to log_path as they come; returns (exit code, stderr tail)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A stale rank from an enclosing launcher would make train.py wait for peers that never come.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    tail: deque[str] = deque(maxlen=400)
    lock = threading.Lock()
    with log_path.open("w") as log:
        log.write(f"$ {_display(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", bufsize=1, env=env)

        def pump(stream: Any, keep: deque[str] | None) -> None:
            for line in stream:
                with lock:
                    log.write(line)
                    log.flush()
                if keep is not None:
                    keep.append(line)

        threads = [threading.Thread(target=pump, args=(proc.stdout, None)),
                   threading.Thread(target=pump, args=(proc.stderr, tail))]
        for t in threads:
            t.start()
        try:
            rc = proc.wait()
        except BaseException:
            # SIGTERM lets the trainer (and torchrun's workers) stop cleanly instead of orphaning them.
            proc.terminate()
            proc.wait()
            raise
        finally:
            for t in threads:
                t.join()
    return rc, list(tail)


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ValueError(f"{path} was not written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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


def run_cell(precision: str, compile_mode: str, cli: argparse.Namespace, extras: list[str],
             out: Path, train_py: str) -> CellResult:
    result = CellResult(precision, compile_mode)
    run_dir = out / "runs" / result.name
    tb_dir = out / "tb" / result.name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(tb_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [*_launcher(cli.nproc, train_py), "--config", cli.config, *extras,
           *cell_overrides(precision, compile_mode, cli.steps, str(run_dir))]
    result.command = _display(cmd)
    result.log = str(run_dir / "log.txt")
    start = time.perf_counter()
    rc, stderr_tail = _stream(cmd, run_dir / "log.txt")
    result.wall_s = time.perf_counter() - start
    result.returncode = rc
    copy_events(run_dir / "tb" / result.name, tb_dir)
    if rc != 0:
        result.reason = failure_reason(stderr_tail, rc)
        return result
    try:
        records = _read_metrics(run_dir / "metrics.jsonl")
        last = max((r["step"] for r in records), default=0)
        if last != cli.steps:
            raise ValueError(f"train.py exited 0 after {last} of {cli.steps} steps")
        for key, value in summarize(records, cli.warmup).items():
            setattr(result, key, value)
        result.ok = True
    except (ValueError, KeyError) as e:
        result.reason = f"unusable metrics: {e}"
    return result


# -- report ------------------------------------------------------------------------------------


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Versions and device names; called after the runs so the parent holds no CUDA context meanwhile."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "cpu": _cpu_name(),
        "os": f"{platform.system()} {platform.release()}",
    }


def write_chart(results: list[CellResult], path: Path, title: str) -> bool:
    """Grouped bars of tokens/s/GPU per compile mode, one colour per precision, speedups on top."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: {path.name} not written: matplotlib is not installed "
              "(pip install matplotlib, or pip install -e '.[plot]')", file=sys.stderr)
        path.unlink(missing_ok=True)  # a chart from an earlier run would not match the table
        return False
    modes = list(dict.fromkeys(r.compile for r in results))
    precisions = list(dict.fromkeys(r.precision for r in results))
    by_cell = {(r.precision, r.compile): r for r in results}
    width = 0.8 / len(precisions)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 + 0.9 * len(modes) * len(precisions)), 4.5))
    for i, precision in enumerate(precisions):
        xs, heights, labels = [], [], []
        for j, mode in enumerate(modes):
            r = by_cell.get((precision, mode))
            xs.append(j + (i - (len(precisions) - 1) / 2) * width)
            heights.append(r.tps if r is not None and r.ok else 0.0)
            if r is None:
                labels.append("not run")
            elif not r.ok:
                labels.append("failed")
            elif r.speedup_vs_bf16_same_compile is None:
                labels.append("")
            else:
                labels.append(_speedup(r.speedup_vs_bf16_same_compile))
        bars = ax.bar(xs, heights, width, label=precision, color=f"C{i}")
        ax.bar_label(bars, labels=labels, padding=2, fontsize=8)
    ax.set_xticks(range(len(modes)), [f"compile {m}" for m in modes])
    ax.set_ylabel("tokens/s per GPU (median)")
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    # Below the axes: inside, the legend covers the tallest bars and their labels.
    ax.legend(title="precision (label: vs bf16, same compile)", fontsize=8, title_fontsize=8,
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(precisions))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- command line ------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _BadArgs(message)


class _BadArgs(Exception):
    pass


def _names(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise _BadArgs(f"{option} needs at least one of {', '.join(allowed)}")
    for n in names:
        if n not in allowed:
            raise _BadArgs(f"{option}: unknown name '{n}' (choose from {', '.join(allowed)})")
    return names


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(options, train.py overrides after `--`); raises _BadArgs with a one-line message."""
    if "--" in argv:
        cut = argv.index("--")
        argv, extras = argv[:cut], argv[cut + 1:]
    else:
        extras = []
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="Arguments after `--` are passed to every train.py run.")
    p.add_argument("--config", required=True, help="train.py TOML config")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run; >1 uses torch.distributed.run")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps per run (default {DEFAULT_STEPS})")
    p.add_argument("--warmup", type=int, default=None, help="steps dropped before the medians (default min(3, steps-1))")
    p.add_argument("--precisions", default="bf16,tensorwise,rowwise", help=f"comma list of {', '.join(PRECISIONS)} (default %(default)s)")
    p.add_argument("--compile", default="none,block,model", help=f"comma list of {', '.join(COMPILE_MODES)} (default %(default)s)")
    p.add_argument("--out", required=True, help="output folder")
    cli = p.parse_args(argv)
    cli.precisions = _names(cli.precisions, PRECISIONS, "--precisions")
    cli.compile = _names(cli.compile, COMPILE_MODES, "--compile")
    if cli.nproc < 1:
        raise _BadArgs(f"--nproc must be >= 1, got {cli.nproc}")
    if cli.steps < 1:
        raise _BadArgs(f"--steps must be >= 1, got {cli.steps}")
    if cli.warmup is None:
        cli.warmup = min(3, cli.steps - 1)
    if not 0 <= cli.warmup < cli.steps:
        raise _BadArgs(f"--warmup must be in [0, steps), got {cli.warmup} with --steps {cli.steps}")
    if not Path(cli.config).is_file():
        raise _BadArgs(f"config file not found: {cli.config}")
    owned = set(_option_names(cell_overrides("rowwise", "none", 1, "x"))) - {"float8.fsdp_float8_all_gather"}
    for name in _option_names(extras):
        if name == "config":
            raise _BadArgs("pass --config before `--`, not after it")
        if name in owned:
            raise _BadArgs(f"--{name} is set for each cell by this script; use --precisions, --compile, --steps or --out")
    return cli, extras


def _check_train_args(cli: argparse.Namespace, extras: list[str]) -> None:
    """Let train.py's own config validation reject bad overrides once, before any run starts."""
    from trainer.config import build_config
    from trainer.errors import UserError

    for precision in cli.precisions:
        for mode in cli.compile:
            try:
                build_config(["--config", cli.config, *extras, *cell_overrides(precision, mode, cli.steps, "x")])
            except UserError as e:
                raise _BadArgs(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli, extras = parse_args(argv)
        _check_train_args(cli, extras)
    except _BadArgs as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    train_py = "train.py" if Path.cwd().resolve() == ROOT else str(ROOT / "train.py")
    script = "scripts/compare_throughput.py" if Path.cwd().resolve() == ROOT else str(Path(__file__).resolve())
    command = shlex.join(["python", script, *argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    cells = [(p, m) for m in cli.compile for p in cli.precisions]
    results = []
    for i, (precision, mode) in enumerate(cells, 1):
        tag = f"[{i}/{len(cells)}] {precision}-{mode}"
        print(f"{tag}: running, log in {out / 'runs' / f'{precision}-{mode}' / 'log.txt'}", flush=True)
        r = run_cell(precision, mode, cli, extras, out, train_py)
        status = f"{r.tps:,.0f} tokens/s/GPU" if r.ok else f"FAILED: {r.reason}"
        print(f"{tag}: {status} ({r.wall_s:.0f} s)", flush=True)
        results.append(r)
    add_speedups(results)

    env = environment()
    info = {"command": command, "date": date, "nproc": cli.nproc, "steps": cli.steps, "warmup": cli.warmup,
            "environment": env}
    report = {
        **info,
        "config": cli.config,
        "train_overrides": extras,
        "precisions": cli.precisions,
        "compile_modes": cli.compile,
        "baseline": f"{BASELINE}-none",
        "cells": [{"name": r.name, **dataclasses.asdict(r)} for r in results],
        "failures": {r.name: r.reason for r in results if not r.ok},
    }
    (out / "comparison.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "comparison.md").write_text(render_markdown(results, info))
    device = env["gpu"] or "CPU"
    title = f"{Path(cli.config).name}: {cli.nproc} x {device}, steps {cli.warmup + 1}-{cli.steps}"
    chart = write_chart(results, out / "comparison.png", title)
    print(f"wrote {out / 'comparison.md'}, {out / 'comparison.json'}"
          + (f", {out / 'comparison.png'}" if chart else "") + f", {out / 'tb'}/", flush=True)
    failures = render_failures(results)
    if failures:
        print(failures)
    print(render_table(results), flush=True)
    return 0 if any(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
