"""Faults a run must survive or refuse cleanly (issue #11): non-finite steps, unusable or busy dump
folders, sequences beyond the model's length, changed settings on resume, earlier runs' records.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.helpers import run_train, write_lock
from tests.trainer.checkpoint.test_end_to_end import one_error_line as error_line
from trainer.checkpoint.state import nonfinite_weights
from trainer.config import build_config
from trainer.errors import UserError
from trainer.metrics.logger import MetricsLogger
from trainer.model_setup import model_args_for
from trainer.optim import lr_multiplier
from trainer.run_folder import acquire_lock, move_previous_records, release_lock

SMALL = [
    "--model.n_layers", "1", "--training.seq_len", "32", "--training.batch_size", "2",
    "--metrics.enable_tensorboard", "false", "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def strict_rows(folder: Path) -> list[dict]:
    def refuse(name: str) -> None:
        raise AssertionError(f"metrics.jsonl holds {name}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def checkpoints(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoints").iterdir())


def poisoned_run(args: list[str], attempts: str) -> subprocess.CompletedProcess:
    return run_train(args, script="tests/wrappers/train_nonfinite.py", env={"NONFINITE_ATTEMPTS": attempts})


# -- 1. non-finite loss or gradient --------------------------------------------------------


@pytest.mark.slow
def test_nonfinite_grad_stops_the_run_and_keeps_the_healthy_checkpoint(tmp_path):
    dump = tmp_path / "run"
    proc = run_train(["--job.dump_folder", str(dump), *SMALL, *CKPT, "--optimizer.lr", "1e6",
                      "--checkpoint.keep_latest_k", "1", "--training.steps", "4"])
    line = error_line(proc)
    assert line.startswith("error: step 2: grad_norm is nan, the step was not applied;"), line
    assert "optimizer.lr" in line and "lr_scheduler.warmup_steps" in line
    # Step 2 was never applied, so nothing of it was saved and the healthy step 1 survives the rotation.
    assert checkpoints(dump) == ["step-1"]
    assert [r["step"] for r in strict_rows(dump)] == [1]


@pytest.mark.slow
def test_skipped_step_is_retried_counted_and_resumable(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT, "--training.skip_nonfinite_steps", "1"]
    proc = poisoned_run([*args, "--training.steps", "4"], "3")
    ok(proc)
    assert "warning: step 3: loss is nan, step skipped and retried on the next batch (1 of at most 1 in a row)" \
        in proc.stderr
    rows = strict_rows(dump)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1]
    # Five batches were read for four applied steps.
    assert rows[-1]["tokens_seen"] == 5 * 2 * 32
    assert checkpoints(dump) == ["step-1", "step-2", "step-3", "step-4"]
    ok(run_train([*args, "--training.steps", "5"]))
    last = strict_rows(dump)[-1]
    assert last["step"] == 5 and last["skipped_steps"] == 0 and last["loss"] < rows[0]["loss"]


@pytest.mark.slow
def test_too_many_nonfinite_steps_in_a_row_stop_the_run(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT, "--training.skip_nonfinite_steps", "1"]
    line = error_line(poisoned_run([*args, "--training.steps", "6"], "3,4"))
    assert line.startswith("error: step 3: loss is nan, the step was not applied "
                           "(2 in a row, training.skip_nonfinite_steps = 1);"), line
    assert checkpoints(dump) == ["step-1", "step-2"]
    # What was saved is healthy: the run resumes from it.
    proc = run_train([*args, "--training.steps", "3"])
    ok(proc)
    assert "resumed from checkpoint at step 2" in proc.stdout
    assert [r["step"] for r in strict_rows(dump)] == [1, 2, 3]


def test_metrics_jsonl_writes_nonfinite_numbers_as_null(tmp_path):
    logger = MetricsLogger(str(tmp_path), "run", enable_tensorboard=False, is_main=True)
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3, "tps": 1.0,
                "memory/peak_active_gib": 0.0, "step_time_s": 1.0}, 1)
    logger.close()
    assert strict_rows(tmp_path) == [{"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "tps": 1.0,
                                      "memory/peak_active_gib": 0.0, "step_time_s": 1.0}]


def test_nonfinite_weights_are_counted():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    assert int(nonfinite_weights(model)) == 0
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")
        model[1].bias[1] = float("nan")
    assert int(nonfinite_weights(model)) == 2


# -- 2. unusable dump folder ------------------------------------------------------------------


@pytest.mark.slow
def test_dump_folder_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "taken"
    target.write_text("not a folder")
    line = error_line(run_train(["--job.dump_folder", str(target), *SMALL]))
    assert line.startswith(f"error: job.dump_folder '{target}' is not a writable folder (FileExistsError"), line
    assert target.read_text() == "not a folder"


@pytest.mark.slow
def test_dump_folder_under_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    target = tmp_path / "file" / "run"
    line = error_line(run_train(["--job.dump_folder", str(target), *SMALL]))
    assert line.startswith(f"error: job.dump_folder '{target}' is not a writable folder (NotADirectoryError"), line


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permissions")
def test_read_only_dump_folder_is_refused(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    try:
        line = error_line(run_train(["--job.dump_folder", str(target), *SMALL]))
    finally:
        target.chmod(0o700)
    assert line.startswith(f"error: job.dump_folder '{target}' is not a writable folder (PermissionError"), line


@pytest.mark.slow
def test_missing_parents_of_the_dump_folder_are_created(tmp_path):
    dump = tmp_path / "a" / "b" / "run"
    ok(run_train(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "1"]))
    assert [r["step"] for r in strict_rows(dump)] == [1]
    assert not list(dump.glob(".probe-*")) and not (dump / ".lock").exists()


# -- 3. sequences beyond the model's length ---------------------------------------------------


@pytest.mark.slow
def test_seq_len_beyond_the_flavour_is_refused(tmp_path):
    line = error_line(run_train(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.seq_len", "4096"]))
    assert line == ("error: training.seq_len = 4096 exceeds the max_seq_len 2048 of model.flavor 'debug'; shorten "
                    "it, or set model.max_seq_len >= 4096 to train on longer sequences than the flavour's")
    line = error_line(run_train(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--training.seq_len", "4096",
                                 "--model.max_seq_len", "3000"]))
    assert line.startswith("error: training.seq_len = 4096 exceeds model.max_seq_len = 3000;"), line


def test_max_seq_len_override_sizes_the_model():
    assert model_args_for(build_config(["--training.seq_len", "64"]), None, "cpu").max_seq_len == 2048
    cfg = build_config(["--training.seq_len", "3000", "--model.max_seq_len", "4096"])
    assert model_args_for(cfg, None, "cpu").max_seq_len == 4096
    with pytest.raises(UserError, match=r"^model.max_seq_len must be >= 0, got -1$"):
        build_config(["--model.max_seq_len", "-1"])


# -- 4. changed settings on resume ------------------------------------------------------------


@pytest.mark.slow
def test_changed_lr_and_schedule_on_resume_warn_and_config_records_what_is_used(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT, "--lr_scheduler.warmup_steps", "2"]
    ok(run_train([*args, "--training.steps", "2", "--optimizer.lr", "1e-3"]))
    proc = run_train([*args, "--training.steps", "4", "--optimizer.lr", "5e-3", "--lr_scheduler.min_lr_ratio", "0.5"])
    ok(proc)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    ckpt = dump / "checkpoints" / "step-2"
    assert warnings == [
        f"warning: optimizer.lr = 0.005 differs from 0.001 in checkpoint {ckpt}: the checkpoint's 0.001 stays "
        "in force (its optimizer state is resumed), and config.toml records it",
        f"warning: lr_scheduler.min_lr_ratio = 0.5 differs from 0.1 in checkpoint {ckpt}: this run's 0.5 applies "
        "from step 3 on (the lr schedule is rebuilt from the config)",
        f"warning: training.steps = 4 differs from 2 in checkpoint {ckpt}: this run's 4 applies "
        "from step 3 on (the lr schedule is rebuilt from the config)",
    ], proc.stderr
    config = (dump / "config.toml").read_text()
    assert "lr = 0.001\n" in config and "min_lr_ratio = 0.5\n" in config and "steps = 4\n" in config
    rows = {r["step"]: r for r in strict_rows(dump)}
    assert sorted(rows) == [1, 2, 3, 4]
    new_schedule = build_config(["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.min_lr_ratio", "0.5"])
    assert rows[3]["lr"] == pytest.approx(1e-3 * lr_multiplier(3, 4, new_schedule.lr_scheduler))
    assert not list(dump.glob("previous-*"))


@pytest.mark.slow
def test_checkpoint_without_the_saved_schedule_still_resumes(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT]
    ok(run_train([*args, "--training.steps", "2"]))
    extra_file = dump / "checkpoints" / "step-2" / "extra.json"
    extra = json.loads(extra_file.read_text())
    assert extra["schedule"] == {"lr_scheduler.warmup_steps": 10, "lr_scheduler.decay": "cosine",
                                 "lr_scheduler.min_lr_ratio": 0.1, "training.steps": 2}
    del extra["schedule"]
    extra_file.write_text(json.dumps(extra))
    # The edit no longer matches checksums.json, which a checkpoint this old would not have.
    proc = run_train([*args, "--training.steps", "3", "--checkpoint.verify_checksums", "false"])
    ok(proc)
    # Three steps end inside configs/debug.toml's warmup (10): the one warning expected.
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "lr_scheduler.warmup_steps = 10" in warnings[0], proc.stderr
    assert "resumed from checkpoint at step 2" in proc.stdout


@pytest.mark.slow
def test_checkpoint_with_a_bad_schedule_is_refused(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT]
    ok(run_train([*args, "--training.steps", "1"]))
    extra_file = dump / "checkpoints" / "step-1" / "extra.json"
    extra = json.loads(extra_file.read_text())
    extra["schedule"]["training.steps"] = "many"
    extra_file.write_text(json.dumps(extra))
    line = error_line(run_train([*args, "--training.steps", "2"]))
    assert line == (f"error: checkpoint {extra_file.parent}: extra.json field 'schedule.training.steps' "
                    'must be of the kind of 2, got "many"')


# -- 5. earlier runs' records --------------------------------------------------------------


@pytest.mark.slow
def test_fresh_run_moves_the_previous_records_aside_once_its_inputs_are_valid(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, "--metrics.enable_tensorboard", "true", "--job.run_name", "r"]
    ok(run_train([*args, "--training.steps", "1"]))
    first = (dump / "metrics.jsonl").read_text()
    # A run refused for its inputs writes nothing.
    error_line(run_train([*args, "--data.path", str(tmp_path / "nope.jsonl")]))
    assert (dump / "metrics.jsonl").read_text() == first and not list(dump.glob("previous-*"))
    proc = run_train([*args, "--training.steps", "2"])
    ok(proc)
    assert f"the previous run's records in {dump} were moved to {dump / 'previous-1'}" in proc.stdout
    assert (dump / "previous-1" / "metrics.jsonl").read_text() == first
    assert (dump / "previous-1" / "config.toml").is_file()
    assert list((dump / "previous-1" / "tb" / "r").glob("events.out.tfevents.*"))
    assert [r["step"] for r in strict_rows(dump)] == [1, 2]
    ok(run_train([*args, "--training.steps", "1"]))
    assert [r["step"] for r in strict_rows(dump / "previous-2")] == [1, 2]


def test_move_previous_records_numbers_after_the_highest(tmp_path):
    assert move_previous_records(tmp_path) is None
    (tmp_path / "previous-7").mkdir()
    (tmp_path / "previous-x").mkdir()
    (tmp_path / "config.toml").write_text("a")
    assert move_previous_records(tmp_path) == tmp_path / "previous-8"
    assert (tmp_path / "previous-8" / "config.toml").read_text() == "a"


# -- 6. two runs in one dump folder -----------------------------------------------------------


@pytest.mark.slow
def test_a_live_run_holding_the_folder_stops_the_second(tmp_path):
    dump = tmp_path / "run"
    lock = write_lock(dump, os.getpid())
    held = lock.read_text()
    line = error_line(run_train(["--job.dump_folder", str(dump), *SMALL]))
    assert line == (f"error: job.dump_folder '{dump}' is in use by another run (pid {os.getpid()} on "
                    f"{socket.gethostname()}, started 2024-01-02 03:04:05); wait for it, use another "
                    f"job.dump_folder, or delete {lock} if that run is gone")
    assert lock.read_text() == held and sorted(p.name for p in dump.iterdir()) == [".lock"]


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_and_released(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dump = tmp_path / "run"
    write_lock(dump, gone.pid)
    proc = run_train(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "1"])
    ok(proc)
    assert (f"warning: taking over the stale lock {dump / '.lock'} of a run that is gone (pid {gone.pid} on "
            f"{socket.gethostname()}, started 2024-01-02 03:04:05)") in proc.stderr
    assert not (dump / ".lock").exists()


@pytest.mark.slow
def test_lock_is_released_after_an_error(tmp_path):
    dump = tmp_path / "run"
    error_line(run_train(["--job.dump_folder", str(dump), *SMALL, "--data.path", str(tmp_path / "nope.jsonl")]))
    assert not (dump / ".lock").exists()


def test_lock_in_process(tmp_path):
    lock = acquire_lock(tmp_path)
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(UserError, match="is in use by another run"):
        acquire_lock(tmp_path)
    lock.write_text("{half a lock")  # a writer killed mid-way: stale
    assert acquire_lock(tmp_path) == lock
    release_lock(lock)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
