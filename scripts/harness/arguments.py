"""What the harness commands' command lines share: the train.py arguments after `--` and their
checks, the command and date a report records, a result file read back, a comma list of names.
Mistakes are one-line UserErrors (trainer.cli.ArgParser's too)."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from scripts.harness.cells import ROOT, cell_overrides, option_names
from trainer.config import build_config
from trainer.errors import UserError


def split_train_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the script's own arguments, the train.py arguments after `--`)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def check_run_counts(cli: argparse.Namespace) -> None:
    """--nproc and --steps positive; --warmup defaulted to min(3, steps-1) and inside [0, steps)."""
    if cli.nproc < 1:
        raise UserError(f"--nproc must be >= 1, got {cli.nproc}")
    if cli.steps < 1:
        raise UserError(f"--steps must be >= 1, got {cli.steps}")
    if cli.warmup is None:
        cli.warmup = min(3, cli.steps - 1)
    if not 0 <= cli.warmup < cli.steps:
        raise UserError(f"--warmup must be in [0, steps), got {cli.warmup} with --steps {cli.steps}")


def check_config_and_overrides(config: str, extras: list[str], unit: str, own_flags: str) -> None:
    """The config file exists, and the train.py arguments after `--` leave alone what the script
    sets for each `unit` (cell or run); `own_flags` names the script's options for those."""
    if not Path(config).is_file():
        raise UserError(f"config file not found: {config}")
    owned = set(option_names(cell_overrides("rowwise", "none", 1, "x", 1))) - {"float8.fsdp_float8_all_gather"}
    for name in option_names(extras):
        if name == "config":
            raise UserError("pass --config before `--`, not after it")
        if name in owned:
            raise UserError(f"--{name} is set for each {unit} by this script; use {own_flags}")


def check_train_overrides(config: str, extras: list[str], cells: Iterable[tuple[str, str, str | None]],
                          steps: int, profile_step: int | None = None) -> None:
    """Let train.py's own config validation reject bad overrides once per (precision, compile mode,
    float8 impl) cell, before any run starts."""
    for precision, mode, impl in cells:
        build_config(["--config", config, *extras, *cell_overrides(precision, mode, steps, "x", profile_step, impl)])


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
    """The distinct names of a comma list, in order; raises UserError for an empty list or an unknown name."""
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise UserError(f"{option} needs at least one of {', '.join(allowed)}")
    for n in names:
        if n not in allowed:
            raise UserError(f"{option}: unknown name '{n}' (choose from {', '.join(allowed)})")
    return names
