"""extra.json, the non-tensor part of a checkpoint, and its checks.

Everything a checkpoint holds besides tensors (step, tokens seen, LR schedule, optimizer
hyperparameters, dataloader position, layout) is JSON, so loading never unpickles anything.
A hand-edited or truncated extra.json is refused before any state is loaded, naming the first
field that does not have the structure and kinds of the live object it would be loaded into.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainer.checkpoint.dcp_reader import describe_error
from trainer.config import LRSchedulerConfig
from trainer.errors import UserError

EXTRA_FILE = "extra.json"
EXTRA_KEYS = (
    "train_state", "lr_scheduler", "optimizer_param_groups", "dataloader", "global_batch", "world_size", "dp", "tp",
)
_LAYOUT_KEYS = ("global_batch", "world_size", "dp", "tp")
# Optional in extra.json (older checkpoints lack them): the schedule the checkpoint was trained with.
SCHEDULE_KEYS = ("lr_scheduler.warmup_steps", "lr_scheduler.decay", "lr_scheduler.min_lr_ratio", "training.steps")
# AdamW fills in its other hyperparameters (foreach, fused, amsgrad, ...) when a group lacks them.
_GROUP_REQUIRED = ("params", "lr", "betas", "eps", "weight_decay")


class _FieldError(Exception):
    """A field of extra.json that does not fit; the message starts with the field's path."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"field '{where}' {problem}")


def schedule_values(lr_scheduler: LRSchedulerConfig, training_steps: int) -> dict[str, Any]:
    """The run's SCHEDULE_KEYS as ``{"section.key": value}``."""
    sections = {"lr_scheduler": lr_scheduler, "training": SimpleNamespace(steps=training_steps)}
    return {key: getattr(sections[key.split(".")[0]], key.split(".")[1]) for key in SCHEDULE_KEYS}


def read_extra(path: Path) -> dict[str, Any]:
    """extra.json of the checkpoint `path` with every EXTRA_KEYS entry; a one-line UserError otherwise."""
    f = path / EXTRA_FILE
    if not f.is_file():
        raise UserError(f"checkpoint {path} is incomplete: extra.json is missing (delete the folder to start from an older one)")
    try:
        extra = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint {path}: extra.json is unreadable ({describe_error(e)})") from None
    missing = [k for k in EXTRA_KEYS if not isinstance(extra, dict) or k not in extra]
    if missing:
        raise UserError(f"checkpoint {path}: extra.json lacks '{missing[0]}'")
    return extra


def param_groups_from_json(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON turns tuples (AdamW's betas) into lists; give the optimizer back what it wrote."""
    return [{k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in g.items()} for g in groups]


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:60] + "..."


def _check_like(value: Any, template: Any, where: str) -> None:
    """`value`, read from JSON, has the structure and kinds of `template`, a live state_dict.

    Integers must be >= 0: every integer in these states is a count or a position.
    Strings must be equal: they name a data kind or a parameter.
    """
    if isinstance(template, dict):
        if not isinstance(value, dict):
            raise _FieldError(where, f"must be an object, got {_show(value)}")
        for key in template:
            if key not in value:
                raise _FieldError(where, f"lacks '{key}'")
        for key in value:
            if key not in template:
                raise _FieldError(f"{where}.{key}", "is unknown to this trainer")
        for key, sub in template.items():
            _check_like(value[key], sub, f"{where}.{key}")
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, list) or len(value) != len(template):
            raise _FieldError(where, f"must be a list of {len(template)} entries, got {_show(value)}")
        for i, (v, sub) in enumerate(zip(value, template)):
            _check_like(v, sub, f"{where}[{i}]")
    elif template is None:
        if value is not None:
            raise _FieldError(where, f"must be null, got {_show(value)}")
    elif isinstance(template, bool):
        if not isinstance(value, bool):
            raise _FieldError(where, f"must be true or false, got {_show(value)}")
    elif isinstance(template, int):
        if type(value) is not int or value < 0:
            raise _FieldError(where, f"must be an integer >= 0, got {_show(value)}")
    elif isinstance(template, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _FieldError(where, f"must be a finite number, got {_show(value)}")
    elif value != template:
        raise _FieldError(where, f"must be {_show(template)}, got {_show(value)}")


def _check_param_groups(groups: Any, template: list[dict[str, Any]], where: str) -> None:
    """Saved optimizer param_groups against the live ones (from ``get_state_dict``)."""
    if not isinstance(groups, list) or len(groups) != len(template):
        raise _FieldError(where, f"must be a list of {len(template)} parameter groups, got {_show(groups)}")
    for i, (group, live) in enumerate(zip(groups, template)):
        here = f"{where}[{i}]"
        if not isinstance(group, dict):
            raise _FieldError(here, f"must be an object, got {_show(group)}")
        for key in _GROUP_REQUIRED:
            if key not in group:
                raise _FieldError(here, f"lacks '{key}'")
        for key, value in group.items():
            if key not in live:
                raise _FieldError(f"{here}.{key}", "is unknown to this optimizer")
            if live[key] is None or isinstance(live[key], bool):
                # Implementation flags (foreach, fused) may change between runs; AdamW takes either.
                if value is not None and not isinstance(value, bool):
                    raise _FieldError(f"{here}.{key}", f"must be true, false or null, got {_show(value)}")
            else:
                _check_like(value, live[key], f"{here}.{key}")


def check_extra(
    path: Path, step: int, extra: dict[str, Any], *, train_state: dict[str, Any], lr_scheduler: dict[str, Any],
    param_groups: list[dict[str, Any]], dataloader: dict[str, Any], schedule: dict[str, Any],
) -> None:
    """Every field of `extra` has the shape of this run's state it loads into; a one-line UserError otherwise.

    The keyword arguments are this run's state dicts and schedule values; `step` is the one
    the folder's name says it holds. Fills in the fields older checkpoints lack.
    """
    try:
        for key in _LAYOUT_KEYS:
            if type(extra[key]) is not int or extra[key] < 1:
                raise _FieldError(key, f"must be an integer >= 1, got {_show(extra[key])}")
        _check_like(extra["train_state"], train_state, "train_state")
        _check_like(extra["lr_scheduler"], lr_scheduler, "lr_scheduler")
        _check_param_groups(extra["optimizer_param_groups"], param_groups, "optimizer_param_groups")
        dataset_state = extra["dataloader"].get("dataset_state") if isinstance(extra["dataloader"], dict) else None
        if isinstance(dataset_state, dict) and dataset_state.get("kind") in ("pretrain", "sft"):
            # Checkpoints from before bad-row counting (data.bad_rows) saw none; mixtures came later.
            dataset_state.setdefault("bad_rows", 0)
        _check_like(extra["dataloader"], dataloader, "dataloader")
        if "schedule" in extra:
            if not isinstance(extra["schedule"], dict) or set(extra["schedule"]) != set(schedule):
                raise _FieldError("schedule", f"must hold exactly {', '.join(schedule)}")
            for key, value in extra["schedule"].items():
                if type(value) is not type(schedule[key]):
                    raise _FieldError(f"schedule.{key}", f"must be of the kind of {_show(schedule[key])}, got {_show(value)}")
        # A checkpoint folder names the step it holds; another step means files were mixed up.
        for key, value in (("train_state.step", extra["train_state"]["step"]),
                           ("lr_scheduler.last_epoch", extra["lr_scheduler"]["last_epoch"])):
            if value != step:
                raise _FieldError(key, f"is {value}, but the folder holds step {step}")
    except _FieldError as e:
        raise UserError(f"checkpoint {path}: extra.json {e}") from None
