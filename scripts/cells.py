"""Running train.py cells as subprocesses and reading what they leave behind.

A cell is one train.py run of one precision x compile mode. scripts/compare_run.py,
gpu_check_runs.py and bench_ac.py build their runs from these parts: the train.py options
that define a cell, the launch command, a run logged as it goes, the reason a run failed,
its metrics.jsonl and their medians, and the machine it ran on. The argument helpers at the
end are what the scripts' command lines share (the train.py arguments after `--` and their
checks, the command and date a report records, a result file read back), with the two rules
for an output that exists: benchmarks keep earlier results (`keep_earlier_results`),
generators refuse (`refuse_to_overwrite`).
"""

from __future__ import annotations

import argparse
import datetime
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.config import CompileMode, Float8Impl, Float8Scaling
from trainer.errors import UserError
from trainer.records import set_aside
from trainer.run_folder import check_writable

ROOT = Path(__file__).resolve().parents[1]
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


class BadArgs(UserError):
    """A command-line mistake; its message is the one line the script prints before exiting 2."""


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser that raises BadArgs instead of printing its usage block and exiting."""

    def error(self, message: str) -> typing.NoReturn:
        raise BadArgs(message)


def split_train_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's own arguments, the train.py arguments after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def check_run_counts(cli: argparse.Namespace) -> None:
    """--nproc and --steps positive; --warmup defaulted to min(3, steps-1) and inside [0, steps)."""
    if cli.nproc < 1:
        raise BadArgs(f"--nproc must be >= 1, got {cli.nproc}")
    if cli.steps < 1:
        raise BadArgs(f"--steps must be >= 1, got {cli.steps}")
    if cli.warmup is None:
        cli.warmup = min(3, cli.steps - 1)
    if not 0 <= cli.warmup < cli.steps:
        raise BadArgs(f"--warmup must be in [0, steps), got {cli.warmup} with --steps {cli.steps}")


def check_config_and_overrides(config: str, extras: list[str], unit: str, own_flags: str) -> None:
    """The config file exists, and the train.py arguments after `--` leave alone what the script
    sets for each `unit` (cell or run); `own_flags` names the script's options for those."""
    if not Path(config).is_file():
        raise BadArgs(f"config file not found: {config}")
    owned = set(option_names(cell_overrides("rowwise", "none", 1, "x", 1))) - {"float8.fsdp_float8_all_gather"}
    for name in option_names(extras):
        if name == "config":
            raise BadArgs("pass --config before `--`, not after it")
        if name in owned:
            raise BadArgs(f"--{name} is set for each {unit} by this script; use {own_flags}")


def check_train_overrides(config: str, extras: list[str], cells: Iterable[tuple[str, str, str | None]],
                          steps: int, profile_step: int | None = None) -> None:
    """Let train.py's own config validation reject bad overrides once per (precision, compile mode,
    float8 impl) cell, before any run starts."""
    from trainer.config import build_config
    from trainer.errors import UserError

    for precision, mode, impl in cells:
        try:
            build_config(["--config", config, *extras,
                          *cell_overrides(precision, mode, steps, "x", profile_step, impl)])
        except UserError as e:
            raise BadArgs(str(e)) from None


def invocation(script_file: str, argv: list[str]) -> tuple[str, str, str]:
    """(train.py's path, the script's command line as typed, the UTC date) for a report: paths
    relative to the repository when run from its root."""
    at_root = Path.cwd().resolve() == ROOT
    script = str(Path(script_file).resolve())
    train_py = "train.py" if at_root else str(ROOT / "train.py")
    shown = str(Path(script).relative_to(ROOT)) if at_root else script
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return train_py, shlex.join(["python", shown, *argv]), date


def load_json_file(path: Path, error: type[Exception]) -> Any:
    """The JSON in `path`; raises `error` with a one-line reason when it is missing, unreadable or not JSON."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as e:
        raise error(f"{path}: cannot read it ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not JSON ({e})") from None


def comma_names(text: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """The distinct names of a comma list, in order; raises BadArgs for an empty list or an unknown name."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise BadArgs(f"{option} needs at least one of {', '.join(allowed)}")
    for n in names:
        if n not in allowed:
            raise BadArgs(f"{option}: unknown name '{n}' (choose from {', '.join(allowed)})")
    return names


def keep_earlier_results(folder: Path, names: Iterable[str]) -> Path | None:
    """Check that `folder` (--out) is a writable folder, then move the entries `names` of it that
    exist into ``folder/previous-N/`` (N = 1, 2, ...), as train.py keeps an earlier run's records,
    and say so in one line.

    Called before any new result is written, so a run that fails leaves the earlier results intact.
    Returns the folder they went to, or None when there was nothing to keep.
    """
    check_writable(folder, "--out")
    present = [folder / name for name in dict.fromkeys(names) if (folder / name).exists()]
    target = set_aside(folder, present, copy=False)
    if target is not None:
        print(f"kept the earlier {', '.join(p.name for p in present)} in {target}/", flush=True)
    return target


def refuse_to_overwrite(paths: Iterable[Path], flag: str = "--force") -> None:
    """Raise BadArgs naming the first of `paths` that exists: a generator overwrites only when asked to."""
    for path in paths:
        if path.exists():
            raise BadArgs(f"{path} exists; pass {flag} to overwrite it, or choose another --out")
