"""Resolving a run's config: TOML file, `--section.key value` overrides, coercion and `--help`.

Precedence: CLI ``--section.key value`` > TOML file > dataclass defaults. Every
problem with the user's config is raised as a one-line :class:`UserError` that
names the key; ``train.py`` turns it into ``error: ...`` and exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from trainer.config.checks import did_you_mean, validate
from trainer.config.schema import SECTIONS, Config, field_types
from trainer.config.sources import SOURCE_REQUIRED
from trainer.config.toml_writer import toml_value
from trainer.errors import UserError

DEFAULT_CONFIG = "configs/debug.toml"


def _type_name(tp: Any) -> str:
    if _table_type(tp) is not None:
        return "an array of tables"
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        return f"a list of {_type_name(inner)}s"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[tp]


def _in_range(value: int | float, where: str) -> int | float:
    """Reject numbers no option can use: NaN and infinities, integers beyond 64 bits."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where} must be a finite number, got {value}")
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        raise UserError(f"{where} = {value} does not fit in 64 bits")
    return value


def _table_type(tp: Any) -> type | None:
    """The dataclass of a field that is an array of tables (`list[SourceConfig]`), else None."""
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        if dataclasses.is_dataclass(inner):
            return inner
    return None


def _coerce_tables(value: Any, cls: type, key: str, origin: str) -> list[Any]:
    """An array of tables (`[[data.sources]]`): every table's keys known and typed, the required ones given."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise UserError(f"{key} in {origin} must be an array of tables ([[{key}]] ...), got {value!r}")
    types_ = typing.get_type_hints(cls)
    out = []
    for i, table in enumerate(value):
        for name in table:
            if name not in types_:
                raise UserError(f"unknown key {key}[{i}].{name}{did_you_mean(name, list(types_))} in {origin}")
        for name in SOURCE_REQUIRED:
            if name not in table:
                raise UserError(f"{key}[{i}] in {origin} needs a {name}")
        out.append(cls(**{name: _coerce(v, types_[name], f"{key}[{i}].{name} in {origin}") for name, v in table.items()}))
    return out


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check a TOML value (already typed) against the field type."""
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"{where} must be {_type_name(tp)}, got {value!r}")
        return [_coerce(v, inner, where) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{where} must be an integer, got {value!r}")
        return _in_range(value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where} must be a number, got {value!r}")
        return _in_range(float(value), where)
    if not isinstance(value, str):
        raise UserError(f"{where} must be a string, got {value!r}")
    return value


def _parse_cli_value(text: str, tp: Any, where: str) -> Any:
    """Turn a command-line string into a value of the field's type."""
    if typing.get_origin(tp) is list:
        (inner,) = typing.get_args(tp)
        body = text.strip()
        if body.startswith("[") and body.endswith("]"):
            body = body[1:-1]
        items = [s.strip().strip("'\"") for s in body.split(",") if s.strip()]
        return [_parse_cli_value(s, inner, where) for s in items]
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UserError(f"{where} must be true or false, got '{text}'")
    if tp is int:
        try:
            return _in_range(int(text), where)
        except ValueError:
            raise UserError(f"{where} must be an integer, got '{text}'") from None
    if tp is float:
        try:
            return _in_range(float(text), where)
        except ValueError:
            raise UserError(f"{where} must be a number, got '{text}'") from None
    return text


def _lookup(section: str, key: str, where: str) -> Any:
    if section not in SECTIONS:
        raise UserError(f"unknown config section [{section}]{did_you_mean(section, list(SECTIONS))} in {where}")
    types_ = field_types(SECTIONS[section])
    if key not in types_:
        raise UserError(f"unknown config key {section}.{key}{did_you_mean(key, list(types_))} in {where}")
    return types_[key]


def load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        if p.exists():
            raise UserError(f"config file {path} is not a regular file (a folder, device or pipe)")
        raise UserError(f"config file not found: {path}")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file") from None


def parse_cli(argv: list[str]) -> tuple[str | None, list[tuple[str, str, str | None]], bool]:
    """Split argv into (--config path, [(section, key, raw value)], wants help)."""
    config_path = None
    overrides: list[tuple[str, str, str | None]] = []
    wants_help = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            wants_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument '{arg}' (options look like --section.key value)")
        name, eq, inline = arg[2:].partition("=")
        value: str | None = inline if eq else None
        if value is None and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 1
        i += 1
        if name == "config":
            if value is None:
                raise UserError("--config needs a path")
            if not value.strip():
                # An unset shell variable: silently training the default config would be worse.
                raise UserError(f"--config is empty (an unset shell variable?); give a config file, or leave "
                                f"--config out for the default {DEFAULT_CONFIG}")
            config_path = value
            continue
        if "." not in name:
            raise UserError(f"unknown option --{name} (options look like --section.key value, e.g. --training.steps 10)")
        section, _, key = name.partition(".")
        overrides.append((section, key, value))
    return config_path, overrides, wants_help


def build_config(argv: list[str] | None = None) -> Config:
    """Resolve the config from argv (defaults < TOML < CLI) and validate it."""
    argv = sys.argv[1:] if argv is None else argv
    config_path, overrides, wants_help = parse_cli(argv)
    if wants_help:
        print(help_text())
        raise SystemExit(0)
    config_path = DEFAULT_CONFIG if config_path is None else config_path
    raw = load_toml(config_path)
    cfg = Config()
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise UserError(f"{config_path}: '{section}' must be a [section] table{did_you_mean(section, list(SECTIONS))}")
        for key, value in table.items():
            tp = _lookup(section, key, config_path)
            table = _table_type(tp)
            coerced = (_coerce(value, tp, f"{section}.{key} in {config_path}") if table is None
                       else _coerce_tables(value, table, f"{section}.{key}", config_path))
            setattr(getattr(cfg, section), key, coerced)
    for section, key, text in overrides:
        tp = _lookup(section, key, "the command line")
        if _table_type(tp) is not None:
            raise UserError(f"--{section}.{key} is an array of tables: set it in the TOML file ([[{section}.{key}]])")
        if text is None:
            if tp is not bool:
                raise UserError(f"--{section}.{key} needs a value")
            text = "true"
        setattr(getattr(cfg, section), key, _parse_cli_value(text, tp, f"--{section}.{key}"))
    validate(cfg)
    return cfg


def help_text() -> str:
    out = [
        "usage: train.py [--config FILE.toml] [--section.key value ...]",
        "",
        f"Options (CLI > TOML > default). Default config: {DEFAULT_CONFIG}",
    ]
    for section, cls in SECTIONS.items():
        out.append(f"\n[{section}]  {(cls.__doc__ or '').strip()}")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            extra = f" {{{'|'.join(choices)}}}" if choices else ""
            out.append(f"  --{section}.{f.name}{extra} (default {toml_value(default)})")
            out.append(f"      {f.metadata['help']}")
    return "\n".join(out)
