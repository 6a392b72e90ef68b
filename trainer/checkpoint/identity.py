"""Which run wrote a checkpoint, and with which tokenizer: recorded in every checkpoint, checked on use.

A run's id is kept in ``<dump_folder>/run_id``, written once the run has accepted its inputs,
so every restart of the run in that dump folder is the same run. Each checkpoint's extra.json
records the id (with a hash of the config and the dump folder) and the tokenizer (piece count
and a digest of its file); a model export records the tokenizer in ``tokenizer_identity.json``.
A run does not resume another run's checkpoint unless told to, and nothing (resume, initial
weights, generation, evaluation) uses a checkpoint with another tokenizer than it was trained
with. Checkpoints written before these records existed carry none, and are accepted.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.checkpoint.dcp_reader import describe_error
from trainer.checkpoint.schema import EXTRA_FILE
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

RUN_ID_FILE = "run_id"
EXPORT_TOKENIZER_FILE = "tokenizer_identity.json"


@dataclass(frozen=True)
class RunIdentity:
    """This run: its id (kept in `id_file`), a hash of its config and its dump folder."""

    id: str
    config_hash: str
    dump_folder: str
    id_file: Path
    kept: bool  # the id was read from id_file: a restart of an earlier run

    @classmethod
    def of_dump_folder(cls, dump_folder: Path, config: dict[str, Any], new_id: str | None = None) -> RunIdentity:
        """The run of `dump_folder`: its kept id, else `new_id` (a fresh random one by default)."""
        id_file = dump_folder / RUN_ID_FILE
        try:
            kept_id = id_file.read_text().strip()
        except OSError:
            kept_id = ""
        text = json.dumps(config, sort_keys=True, default=str)
        return cls(id=kept_id or new_id or new_run_id(), config_hash=hashlib.sha256(text.encode()).hexdigest()[:16],
                   dump_folder=str(dump_folder.resolve()), id_file=id_file, kept=bool(kept_id))

    def record(self) -> dict[str, str]:
        """What extra.json records of the run."""
        return {"id": self.id, "config_hash": self.config_hash, "dump_folder": self.dump_folder}

    def keep(self) -> None:
        """Write the id to the dump folder unless it is there already (rank 0, once the inputs are accepted)."""
        if self.kept or self.id_file.is_file():
            return
        tmp = self.id_file.with_name(self.id_file.name + ".tmp")
        try:
            tmp.write_text(self.id + "\n")
            os.replace(tmp, self.id_file)
        except OSError as e:
            raise UserError(f"job.dump_folder: cannot write {self.id_file} ({describe_error(e)})") from None


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def recorded(checkpoint: Path, key: str) -> Any:
    """extra.json's `key` of the checkpoint folder `checkpoint`, or None when it has none or cannot be read
    (a damaged extra.json is reported by the full checks of trainer/checkpoint/load.py)."""
    try:
        extra = json.loads((checkpoint / EXTRA_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return extra.get(key) if isinstance(extra, dict) else None


def check_owner(checkpoint: Path, folder: Path, run: RunIdentity, resume_from_other_run: bool) -> None:
    """Refuse to resume `checkpoint` (in checkpoint.folder `folder`) when another run wrote it, unless allowed."""
    other = recorded(checkpoint, "run")
    if resume_from_other_run or not isinstance(other, dict) or other.get("id") in (None, run.id):
        return
    this = "a new run" if not run.kept else f"run {run.id}"
    raise UserError(
        f"checkpoint.folder '{folder}' holds checkpoints of another run: {checkpoint.name} was written by run "
        f"{other.get('id')} of job.dump_folder '{other.get('dump_folder')}', and this is {this} in "
        f"'{run.dump_folder}'; set checkpoint.resume_from_other_run = true to continue from it, or use another "
        "checkpoint.folder"
    )


def check_same_tokenizer(recorded_identity: Any, current: dict[str, Any], what: str) -> None:
    """Refuse `what` (a checkpoint or export, named in the message) trained with another tokenizer than `current`.

    Nothing recorded (an older checkpoint, HF or Meta weights) passes.
    """
    if not isinstance(recorded_identity, dict):
        return
    keys = ("vocab_size", "sha256")
    if all(recorded_identity.get(k) == current[k] for k in keys):
        return
    raise UserError(
        f"{what} was trained with another tokenizer ({recorded_identity.get('path')}: "
        f"{recorded_identity.get('vocab_size')} pieces, sha256 {recorded_identity.get('sha256')}) than "
        f"model.tokenizer_path {current['path']} ({current['vocab_size']} pieces, sha256 {current['sha256']}); "
        "set model.tokenizer_path to the tokenizer it was trained with"
    )


def check_tokenizer(path: str | Path, tokenizer: Tokenizer | dict[str, Any]) -> None:
    """Refuse weights at `path` recorded as trained with another tokenizer; a one-line UserError.

    `path`: a checkpoint folder ``step-N``, an export folder (``final/``) or its ``model.safetensors``;
    weights without a record (HF, Meta, older checkpoints) pass. `tokenizer`: a Tokenizer or its identity().
    For scripts (generate, evaluation) and the initial weights of a run.
    """
    current = tokenizer.identity() if isinstance(tokenizer, Tokenizer) else tokenizer
    path = Path(path)
    folder = path.parent if path.is_file() else path
    if (folder / EXTRA_FILE).is_file():
        check_same_tokenizer(recorded(folder, "tokenizer"), current, f"checkpoint {folder}")
        return
    try:
        identity = json.loads((folder / EXPORT_TOKENIZER_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return
    check_same_tokenizer(identity, current, f"exported model {folder}")
