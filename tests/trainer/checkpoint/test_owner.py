"""Whose checkpoints these are (run id, tokenizer) and the save after an unexpected failure, in-process:
the CheckpointManager of tests/trainer/checkpoint/test_manager.py under a gloo process group of one rank."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import ROOT
from tests.trainer.checkpoint.test_manager import STEPS, Run
from trainer.checkpoint.identity import RUN_ID_FILE, RunIdentity, check_tokenizer
from trainer.config import Config
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError


@pytest.fixture(autouse=True)
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(ROOT / "data" / "tokenizer.model"))


def run_of(dump: Path, tok, seed: int = 0, **checkpoint: object) -> Run:
    """A Run whose checkpoints (in dump/checkpoints) record the run of `dump` and the tokenizer, as in train.py."""
    dump.mkdir(parents=True, exist_ok=True)
    return with_identity(Run(dump / "checkpoints", tok, seed, **checkpoint), dump, tok.identity())


def with_identity(run: Run, dump: Path, tokenizer_identity: dict) -> Run:
    identity = RunIdentity.of_dump_folder(dump, Config().to_dict())
    run.manager.context = dataclasses.replace(run.manager.context, run=identity, tokenizer=tokenizer_identity)
    return run


def test_checkpoints_record_the_run_and_tokenizer_and_a_restart_resumes_them(tmp_path, tokenizer):
    dump = tmp_path / "a"
    first = run_of(dump, tokenizer)
    first.start()
    run_id = (dump / RUN_ID_FILE).read_text().strip()  # kept once the run accepted its inputs
    first.step()
    extra = json.loads((dump / "checkpoints" / "step-1" / "extra.json").read_text())
    assert extra["run"] == {"id": run_id, "config_hash": first.manager.context.run.config_hash,
                            "dump_folder": str(dump.resolve())}
    assert extra["tokenizer"] == tokenizer.identity() and len(extra["tokenizer"]["sha256"]) == 16
    again = run_of(dump, tokenizer, seed=1)
    assert again.manager.context.run.id == run_id and again.start() is True


def test_a_new_run_does_not_resume_another_runs_checkpoints_unless_told(tmp_path, tokenizer):
    first = run_of(tmp_path / "a", tokenizer)
    first.start()
    first.step()
    partial = tmp_path / "a" / "checkpoints" / "step-2.partial"
    partial.mkdir()  # as if the first run were writing it
    (tmp_path / "b").mkdir()
    other = with_identity(Run(tmp_path / "a" / "checkpoints", tokenizer, seed=1), tmp_path / "b", tokenizer.identity())
    with pytest.raises(UserError) as error:
        other.start()
    assert str(error.value) == (
        f"checkpoint.folder '{tmp_path / 'a' / 'checkpoints'}' holds checkpoints of another run: step-1 was written "
        f"by run {first.manager.context.run.id} of job.dump_folder '{(tmp_path / 'a').resolve()}', and this is a new "
        f"run in '{(tmp_path / 'b').resolve()}'; set checkpoint.resume_from_other_run = true to continue from it, "
        "or use another checkpoint.folder")
    assert partial.is_dir() and not (tmp_path / "b" / RUN_ID_FILE).exists()  # a refused run touches nothing
    allowed = with_identity(Run(tmp_path / "a" / "checkpoints", tokenizer, seed=1, resume_from_other_run=True),
                            tmp_path / "b", tokenizer.identity())
    assert allowed.start() is True and allowed.state.step == 1


def test_a_checkpoint_of_another_tokenizer_is_refused_on_resume_and_by_the_scripts_helper(tmp_path, tokenizer):
    dump = tmp_path / "a"
    first = run_of(dump, tokenizer)
    first.start()
    first.step()
    other_tokenizer = {"vocab_size": 1000, "sha256": "0123456789abcdef", "path": "small.model"}
    expected = re.escape(
        f"checkpoint {dump / 'checkpoints' / 'step-1'} was trained with another tokenizer ({tokenizer.path}: "
        f"2048 pieces, sha256 {tokenizer.identity()['sha256']}) than model.tokenizer_path small.model (1000 pieces, "
        "sha256 0123456789abcdef); set model.tokenizer_path to the tokenizer it was trained with")
    resumed = with_identity(Run(dump / "checkpoints", tokenizer, seed=1), dump, other_tokenizer)
    with pytest.raises(UserError, match=f"^{expected}$"):
        resumed.start()
    with pytest.raises(UserError, match=f"^{expected}$"):
        check_tokenizer(dump / "checkpoints" / "step-1", other_tokenizer)
    check_tokenizer(dump / "checkpoints" / "step-1", tokenizer)  # the same one passes


def test_an_export_records_its_tokenizer(tmp_path, tokenizer):
    run = run_of(tmp_path, tokenizer, export_final=True, export_dtype="float32")
    run.start()
    for _ in range(STEPS):
        run.step()
    run.manager.maybe_export_final()
    export = tmp_path / "checkpoints" / "final"
    check_tokenizer(export / "model.safetensors", tokenizer)
    with pytest.raises(UserError, match=f"^exported model {re.escape(str(export))} was trained with another tokenizer"):
        check_tokenizer(export / "model.safetensors", {**tokenizer.identity(), "sha256": "ffffffffffffffff"})


def test_the_save_after_a_failure_saves_only_a_completed_step(tmp_path, tokenizer):
    run = Run(tmp_path, tokenizer, seed=0)
    run.manager.cfg = dataclasses.replace(run.manager.cfg, interval=100)
    run.start()
    run.step()
    data_state = run.dataloader.state_dict()
    # Right after the step, before the next step's batches are read: the loop is between steps only
    # once it read them, so this is the start of the next step.
    assert run.manager.save_after_failure(data_state) == (
        "no checkpoint saved (it failed in the middle of a step); no complete checkpoint exists yet")
    next(run._batches)  # the loop reads the next step's batches before it records the step
    assert run.manager.save_after_failure(data_state) == "checkpoint of step 1 saved"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    assert run.manager.save_after_failure(data_state) == "step-1 was saved before the failure"
    run.step()
    data_state = run.dataloader.state_dict()
    next(run._batches)
    run.lr_scheduler.step()  # the schedule went on to step 3, which the loop has not counted
    assert run.manager.save_after_failure(data_state) == (
        "no checkpoint saved (it failed in the middle of a step); step-1 is the latest complete one")
    off = Run(tmp_path / "off", tokenizer, seed=0)
    off.manager.cfg = dataclasses.replace(off.manager.cfg, enable=False)
    assert off.manager.save_after_failure(None) == "no checkpoint (checkpointing disabled)"
