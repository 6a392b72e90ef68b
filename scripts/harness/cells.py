"""Running train.py cells as subprocesses and reading what they leave behind.

A cell is one train.py run of one precision x compile mode. compare/run.py, gpu_check/runs.py
and scripts/bench_ac.py build their runs from these parts: the train.py options that define a
cell, the launch command, a run logged as it goes, the reason a run failed, its metrics.jsonl
and their medians, and the machine it ran on. What the commands' command lines share is
arguments.py's.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import threading
import typing
from collections import deque
from pathlib import Path
from typing import Any

from trainer.config import CompileMode, Float8Impl, Float8Scaling

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("bf16", *typing.get_args(Float8Scaling))
COMPILE_MODES = typing.get_args(CompileMode)
IMPLS = typing.get_args(Float8Impl)
BASELINE = "bf16"
DEFAULT_IMPL = "ours"


def precision_label(precision: str, impl: str = DEFAULT_IMPL) -> str:
    """A cell's precision as tables and charts name it: the recipe, with its float8 implementation
    unless it is ours (tensorwise-torchao); bf16 has none."""
    return precision if precision == BASELINE or impl == DEFAULT_IMPL else f"{precision}-{impl}"


def cell_overrides(precision: str, compile_mode: str, steps: int, dump_folder: str,
                   profile_step: int | None = None, impl: str | None = None) -> list[str]:
    """train.py options that define a cell; they come after the user's, so they win. `impl` sets
    float8.impl for a float8 cell (None: the config's)."""
    name = f"{precision_label(precision, impl or DEFAULT_IMPL)}-{compile_mode}"
    args = ["--float8.enabled", "false" if precision == BASELINE else "true"]
    if precision != BASELINE:
        args += ["--float8.scaling", precision]
        if impl is not None:
            args += ["--float8.impl", impl]
    if precision not in ("tensorwise", "blockwise"):
        # float8 all-gather exists for these recipes only; a config that turns it on (7b_fp8.toml)
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


def option_names(args: list[str]) -> list[str]:
    """The dotted names of the `--name value` / `--name=value` options in a train.py argument list."""
    return [a[2:].partition("=")[0] for a in args if a.startswith("--")]


def train_launcher(nproc: int, train_py: str) -> list[str]:
    """The command that starts train.py: plain python for one process, torch.distributed.run for more."""
    if nproc == 1:
        return [sys.executable, train_py]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", train_py]


def display_command(cmd: list[str]) -> str:
    """cmd as a user would type it: `python` for this interpreter's full path."""
    return shlex.join(["python", *cmd[1:]]) if cmd[0] == sys.executable else shlex.join(cmd)


def run_logged(cmd: list[str], log_path: Path, timeout: float | None = None,
               cwd: Path | None = None) -> tuple[int, list[str]]:
    """Run cmd, writing stdout and stderr to log_path as they come; returns (exit code, stderr tail).

    Past `timeout` seconds the run is stopped and subprocess.TimeoutExpired raised.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A stale rank from an enclosing launcher would make train.py wait for peers that never come.
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    tail: deque[str] = deque(maxlen=400)
    lock = threading.Lock()
    with log_path.open("w") as log:
        log.write(f"$ {display_command(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", bufsize=1, env=env, cwd=cwd)

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
            rc = proc.wait(timeout)
        except BaseException:
            # SIGTERM lets the trainer (and torchrun's workers) stop cleanly instead of orphaning them.
            proc.terminate()
            proc.wait()
            raise
        finally:
            for t in threads:
                t.join()
    return rc, list(tail)


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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a finished run's metrics.jsonl; raises ValueError if it was not written."""
    if not path.is_file():
        raise ValueError(f"{path} was not written")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_metrics(records: list[dict[str, Any]], warmup: int,
                      exclude: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Per-cell numbers from metrics.jsonl records (log_freq 1); raises ValueError if unusable.

    Steps in `exclude` (a profiled step and the one after it) are left out of the medians.
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
