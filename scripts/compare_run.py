"""Running one comparison cell: the train.py command, its log, its metrics and its failure reason.

Used by scripts/compare_throughput.py (and scripts/gpu_check.py); compare_report.py turns
the CellResults into tables and compare_chart.py into the chart.
"""

from __future__ import annotations

import argparse
import dataclasses
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
import typing
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from profile_summary import TraceError, load_trace  # noqa: E402
from profile_summary import summarize as summarize_trace  # noqa: E402

from trainer.config import CompileMode, Float8Scaling  # noqa: E402

PRECISIONS = ("bf16", *typing.get_args(Float8Scaling))
COMPILE_MODES = typing.get_args(CompileMode)
BASELINE = "bf16"


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
    # scripts/profile_summary.py's summary of the profiled step (rank 0), or {"error": ...}.
    profile: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return f"{self.precision}-{self.compile}"


def cell_overrides(precision: str, compile_mode: str, steps: int, dump_folder: str,
                   profile_step: int | None = None) -> list[str]:
    """train.py options that define a cell; they come after the user's, so they win."""
    name = f"{precision}-{compile_mode}"
    args = ["--float8.enabled", "false" if precision == BASELINE else "true"]
    if precision != BASELINE:
        args += ["--float8.scaling", precision]
    if precision != "tensorwise":
        # float8 all-gather exists for tensorwise only; a config that turns it on (7b_fp8.toml)
        # must not carry it into the other cells, where the advisor would flag it.
        args += ["--float8.fsdp_float8_all_gather", "false"]
    profiling = ["--profiling.enable", "false"]
    if profile_step is not None:
        profiling = ["--profiling.enable", "true", "--profiling.steps", str(profile_step)]
    return [
        *args,
        "--compile.mode", compile_mode,
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "true",
        "--job.dump_folder", dump_folder,
        "--job.run_name", name,
        "--checkpoint.enable", "false",
        *profiling,
    ]


def _option_names(args: list[str]) -> list[str]:
    return [a[2:].partition("=")[0] for a in args if a.startswith("--")]


def summarize(records: list[dict[str, Any]], warmup: int, exclude: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Per-cell numbers from metrics.jsonl records (log_freq 1); raises ValueError if unusable.

    Steps in `exclude` (a profiled step, slowed by the profiler) are left out of the medians.
    """
    records = sorted(records, key=lambda r: r["step"])
    measured = [r for r in records if r["step"] > warmup and r["step"] not in exclude]
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


def profile_of(run_dir: Path, step: int) -> dict[str, Any]:
    """Summary of rank 0's trace of `step`, or {"error": reason} when there is none to read."""
    try:
        return summarize_trace(load_trace(run_dir / "profiles" / f"step-{step}" / "rank-0.json"))
    except TraceError as e:
        return {"error": str(e)}


def run_cell(precision: str, compile_mode: str, cli: argparse.Namespace, extras: list[str],
             out: Path, train_py: str) -> CellResult:
    result = CellResult(precision, compile_mode)
    run_dir = out / "runs" / result.name
    tb_dir = out / "tb" / result.name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(tb_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [*_launcher(cli.nproc, train_py), "--config", cli.config, *extras,
           *cell_overrides(precision, compile_mode, cli.steps, str(run_dir), cli.profile_step)]
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
    profiled = frozenset() if cli.profile_step is None else frozenset({cli.profile_step})
    try:
        records = _read_metrics(run_dir / "metrics.jsonl")
        last = max((r["step"] for r in records), default=0)
        if last != cli.steps:
            raise ValueError(f"train.py exited 0 after {last} of {cli.steps} steps")
        for key, value in summarize(records, cli.warmup, profiled).items():
            setattr(result, key, value)
        result.ok = True
    except (ValueError, KeyError) as e:
        result.reason = f"unusable metrics: {e}"
    if cli.profile_step is not None:
        result.profile = profile_of(run_dir, cli.profile_step)
    return result


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
