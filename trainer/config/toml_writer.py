"""The resolved config as TOML (`<dump_folder>/config.toml`), which `--config` reads back."""

from __future__ import annotations

import json
from typing import Any

from trainer.config.schema import Config


def toml_value(value: Any) -> str:
    """`value` as a TOML literal."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # a table of an array of tables ([[data.sources]]), written inline
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def to_toml(cfg: Config) -> str:
    """Every section and key of `cfg`, defaults included."""
    lines: list[str] = []
    for section, values in cfg.to_dict().items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)
