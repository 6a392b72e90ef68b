"""Checkpoints end to end: exact resume (1 process, FSDP=2, across dp degrees), atomic saves,
signals, async saves, keep_latest_k, load_step, damaged or crafted checkpoints, export and
initial weights.

Runs are launched as a user would (train.py, torchrun) on the shipped tiny model and data.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from tests.helpers import ROOT, free_port, read_metrics, run_script, run_train
from trainer.checkpoint.dcp_reader import read_dcp_metadata
from trainer.errors import UserError

# warmup_steps = 5 makes the learning rate of steps 1..5 independent of training.steps, so
# a 5-step first leg and a 10-step run see the same schedule there. Two layers: a resume is
# exact or not whatever the depth. float32 parameters: the
# DP-degree comparison is of layouts, which bf16 rounding blurs by a machine-dependent amount
# (AMX bf16 kernels on torch 2.11: 2.3e-3 apart at step 16, 2026-12-01).
BASE = [
    "--training.mixed_precision_param", "float32", "--model.n_layers", "2",
    "--training.batch_size", "4", "--training.seq_len", "64", "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "5",
    "--checkpoint.enable", "true", "--checkpoint.interval", "100",
]


def losses(folder: Path) -> dict[int, float]:
    """step -> loss of metrics.jsonl, whose steps must follow each other (BASE logs every step).

    A resumed run that left the killed run's rows in place would log a step twice.
    """
    rows = read_metrics(folder)
    steps = [r["step"] for r in rows]
    assert steps and steps == list(range(steps[0], steps[0] + len(steps))), steps
    return {r["step"]: r["loss"] for r in rows}


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """Exit 2 with exactly one `error:` line per rank and no traceback; returns the line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").iterdir())


def start_train(args: list[str], log: Path, nproc: int = 1) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "train.py", *args]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "train.py", *args]
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 240, poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, "the run ended before the expected moment"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def workers(proc: subprocess.Popen) -> list[int]:
    """The training processes: the process itself, or torchrun's children."""
    children = []
    for task in Path(f"/proc/{proc.pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


@pytest.fixture(scope="module")
def ref1(tmp_path_factory) -> Path:
    """10 steps, 1 process; async saves every 4 steps and at the end, keep 2; fp32 export at the end."""
    out = tmp_path_factory.mktemp("ref1")
    ok(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(out),
                  "--checkpoint.interval", "4", "--checkpoint.async_mode", "async",
                  "--checkpoint.keep_latest_k", "2", "--checkpoint.export_final", "true",
                  "--checkpoint.export_dtype", "float32"]))
    return out


@pytest.fixture(scope="module")
def ref2(tmp_path_factory) -> Path:
    """10 steps, FSDP over 2 processes (global batch 8)."""
    out = tmp_path_factory.mktemp("ref2")
    ok(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(out)], nproc=2))
    return out


@pytest.mark.slow
@pytest.mark.version_specific
def test_async_saves_keep_latest_k_and_export(ref1):
    assert checkpoints(ref1) == ["final", "step-10", "step-8"]
    assert len(losses(ref1)) == 10
    assert (ref1 / "checkpoints" / "final" / "model.safetensors").is_file()
    extra = json.loads((ref1 / "checkpoints" / "step-10" / "extra.json").read_text())
    assert extra["train_state"]["step"] == 10 and extra["global_batch"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_and_resume_is_bitwise(ref1, ref2, tmp_path, nproc):
    """SIGTERM (to the worker processes under torchrun) -> finish the step, save, exit 0; resume is exact."""
    ref = ref1 if nproc == 1 else ref2
    log = tmp_path / "leg1.log"
    proc = start_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path)], log, nproc)
    wait_for(lambda: "step      1/10" in log.read_text(), proc)
    for pid in [proc.pid] if nproc == 1 else workers(proc):
        os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "received signal 15" in text and "on request; checkpoint saved" in text
    (stopped,) = [int(n.removeprefix("step-")) for n in checkpoints(tmp_path)]
    assert 1 <= stopped < 10
    out = ok(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path)], nproc=nproc))
    assert f"resumed from checkpoint at step {stopped}" in out
    assert losses(tmp_path) == losses(ref)


def continue_run(ref: Path, dump: Path) -> None:
    """Make `dump` the dump folder of the run `ref`: its checkpoints are this run's own, not another's."""
    dump.mkdir(parents=True, exist_ok=True)
    shutil.copy(ref / "run_id", dump / "run_id")


@pytest.mark.slow
def test_load_step_resumes_an_older_async_checkpoint(ref1, tmp_path):
    shutil.copytree(ref1 / "checkpoints", tmp_path / "checkpoints")
    continue_run(ref1, tmp_path)
    out = ok(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path),
                        "--checkpoint.load_step", "8"]))
    assert "resumed from checkpoint at step 8" in out
    resumed = losses(tmp_path)
    assert sorted(resumed) == [9, 10]
    assert all(resumed[s] == losses(ref1)[s] for s in resumed)


# train.py with a stall inside the save of step 5, at the point named by argv[1]: the process
# sits there until the test kills it, so the kill always lands mid-save. It hooks public
# functions only (DCP's save, the rename into place), so moving the trainer's code keeps it working.
_STALL_IN_SAVE = """
import os, sys, time
import torch.distributed.checkpoint as dcp
import train

owner, name = (dcp, "save") if sys.argv[1] == "write" else (os, "replace")
real = getattr(owner, name)

def stall(*args, **kwargs):
    if any(str(a).endswith("step-5.partial") for a in [*args, *kwargs.values()]):
        print("stalled in the save of step 5", flush=True)
        time.sleep(600)
    return real(*args, **kwargs)

setattr(owner, name, stall)
sys.exit(train.main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["write", "publish"])
def test_kill9_during_save_leaves_previous_checkpoint(ref1, tmp_path, point):
    """SIGKILL before the shards of step-5.partial are written, or after but before its rename:
    step-4 stays the latest, the resume is exact and metrics.jsonl loses the killed run's step 5."""
    folder = tmp_path / "checkpoints"
    args = [*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path),
            "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "3"]
    log = tmp_path / "leg1.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", _STALL_IN_SAVE, point, *args], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "stalled in the save of step 5" in log.read_text(), proc)
    finally:
        proc.kill()  # SIGKILL, the crash under test; also ends a run that never stalled
        proc.wait()
    assert checkpoints(tmp_path) == ["step-2", "step-3", "step-4", "step-5.partial"]
    assert (folder / "step-5.partial" / ".metadata").is_file() == (point == "publish")
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    out = ok(run_train(args))
    assert "resumed from checkpoint at step 4" in out
    assert losses(tmp_path) == losses(ref1)
    assert not [n for n in os.listdir(folder) if not n.startswith("step-") or not n[5:].isdigit()]


@pytest.mark.slow
@pytest.mark.version_specific
@pytest.mark.parametrize("nproc", [1, 2])
def test_stop_at_5_resume_to_10_is_bitwise(ref1, ref2, tmp_path, nproc):
    """5 steps, then a run to 10 from the step-5 checkpoint: the losses of one 10-step run."""
    ok(run_train([*BASE, "--training.steps", "5", "--job.dump_folder", str(tmp_path)], nproc=nproc))
    assert checkpoints(tmp_path) == ["step-5"]
    # What a run killed after its last checkpoint leaves: rows past it, the last one half-written.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 6, "loss": 0.0}) + "\n" + '{"step": 7, "lo')
    out = ok(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path)], nproc=nproc))
    assert "resumed from checkpoint at step 5" in out
    assert losses(tmp_path) == losses(ref1 if nproc == 1 else ref2)


@pytest.mark.slow
def test_sigterm_without_checkpointing_says_nothing_is_saved(tmp_path):
    log = tmp_path / "run.log"
    proc = start_train([*BASE, "--checkpoint.enable", "false", "--training.steps", "10",
                        "--job.dump_folder", str(tmp_path)], log)
    wait_for(lambda: "step      1/10" in log.read_text(), proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "finishing this step, not saving (checkpointing disabled), then exiting" in text
    assert "on request; no checkpoint (checkpointing disabled)" in text
    assert "saving a checkpoint" not in text and "checkpoint saved" not in text
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow
@pytest.mark.version_specific
def test_resume_on_another_dp_degree(ref2, tmp_path):
    """dp=1 x batch 8 -> dp=2 x batch 4 continues the same run; another global batch is refused."""
    leg1 = [*BASE, "--training.batch_size", "8", "--training.steps", "5", "--job.dump_folder", str(tmp_path)]
    ok(run_train(leg1))
    ref = losses(ref2)
    for step, loss in losses(tmp_path).items():  # dp=1 and dp=2 compute the same steps
        assert math.isclose(loss, ref[step], rel_tol=2e-3), (step, loss, ref[step])

    line = one_error_line(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path)]))
    assert "global batch of 8" in line and "uses 4" in line

    out = ok(run_train([*BASE, "--training.steps", "10", "--job.dump_folder", str(tmp_path)], nproc=2))
    assert "resumed from checkpoint at step 5" in out
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(6, 11):
        assert math.isclose(resumed[step], ref[step], rel_tol=2e-3), (step, resumed[step], ref[step])


def _damage_layers(step: Path) -> list[str]:
    return ["--model.n_layers", "1"]


def _damage_truncate(step: Path) -> list[str]:
    (shard,) = step.glob("*.distcp")
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    # Past the checksums (tests/trainer/checkpoint/test_integrity.py), to DCP's own error.
    return ["--checkpoint.verify_checksums", "false"]


def _damage_extra(step: Path) -> list[str]:
    (step / "extra.json").unlink()
    return []


def _edit_extra(edit):
    """A damage that rewrites extra.json as well-formed JSON with `edit` applied to its dict."""

    def damage(step: Path) -> list[str]:
        extra = json.loads((step / "extra.json").read_text())
        edit(extra)
        (step / "extra.json").write_text(json.dumps(extra))
        return []

    return damage


def _damage_rng_folder(step: Path) -> list[str]:
    shutil.rmtree(step / "rng")
    return []


def _damage_rng_file(step: Path) -> list[str]:
    (step / "rng" / "rank-0.safetensors").unlink()
    return []


@pytest.mark.slow
@pytest.mark.parametrize(("damage", "expected"), [
    (_damage_layers, "has 9 weights this model lacks, e.g. 'layers.1."),
    (_damage_truncate, "cannot be loaded"),
    (_damage_extra, "extra.json is missing"),
    (_edit_extra(lambda e: e.update(train_state={})), "extra.json field 'train_state' lacks 'step'"),
    (_edit_extra(lambda e: e["train_state"].update(step="x")),
     "field 'train_state.step' must be an integer >= 0, got \"x\""),
    (_edit_extra(lambda e: e["train_state"].update(step=7)), "'train_state.step' is 7, but the folder holds step 10"),
    (_edit_extra(lambda e: e.update(optimizer_param_groups=[])),
     "field 'optimizer_param_groups' must be a list of 2 parameter groups, got []"),
    (_edit_extra(lambda e: e["optimizer_param_groups"][1].pop("betas")),
     "field 'optimizer_param_groups[1]' lacks 'betas'"),
    (_edit_extra(lambda e: e["lr_scheduler"].update(_last_lr=None)), "field 'lr_scheduler._last_lr' must be a list"),
    (_edit_extra(lambda e: e.update(dataloader={})), "field 'dataloader' lacks '"),
    (_edit_extra(lambda e: e["dataloader"]["dataset_state"].update(kind="sft")),
     "field 'dataloader.dataset_state.kind' must be \"pretrain\", got \"sft\""),
    (_edit_extra(lambda e: e.update(global_batch="4")), "field 'global_batch' must be an integer >= 1"),
    (_damage_rng_folder, "is incomplete: rng/ is missing"),
    (_damage_rng_file, "is incomplete: rng/rank-0.safetensors is missing"),
])
def test_bad_checkpoint_is_one_line_exit_2(ref1, tmp_path, damage, expected):
    step = tmp_path / "checkpoints" / "step-10"
    shutil.copytree(ref1 / "checkpoints" / "step-10", step)
    continue_run(ref1, tmp_path)
    extra_args = damage(step)
    line = one_error_line(run_train([*BASE, "--training.steps", "15", "--job.dump_folder", str(tmp_path), *extra_args]))
    assert expected in line and "step-10" in line, line


class _Touch:
    """Unpickling it runs `touch path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _plant_pickle(step: Path, marker: Path) -> str:
    """Mark an optimizer tensor of checkpoint `step` as bytes: a pickle that creates `marker`."""
    md = read_dcp_metadata(step, "checkpoint")
    key = next(k for k in md.state_dict_metadata if k.startswith("app.optimizer.state.") and k.endswith(".step"))
    torch.save(_Touch(marker), step / "evil.bin")
    md.state_dict_metadata[key] = BytesStorageMetadata()
    for index in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[index]
    md.storage_data[MetadataIndex(key)] = _StorageInfo("evil.bin", 0, (step / "evil.bin").stat().st_size)
    with (step / ".metadata").open("wb") as f:
        pickle.dump(md, f)
    return key


@pytest.mark.slow
@pytest.mark.version_specific
@pytest.mark.parametrize("how", ["resume", "initial_load"])
def test_checkpoint_with_a_pickled_entry_is_refused(ref1, tmp_path, how):
    """A .metadata that marks any entry (here an optimizer step) as bytes would make DCP unpickle it."""
    step = tmp_path / "checkpoints" / "step-10"
    shutil.copytree(ref1 / "checkpoints" / "step-10", step)
    continue_run(ref1, tmp_path)
    marker = tmp_path / "PWNED"
    key = _plant_pickle(step, marker)
    args = [*BASE, "--training.steps", "15", "--job.dump_folder", str(tmp_path)]
    if how == "initial_load":
        args += ["--job.dump_folder", str(tmp_path / "fresh"), "--checkpoint.initial_load_path", str(step),
                 "--checkpoint.initial_load_format", "dcp"]
    line = one_error_line(run_train(args))
    assert f"step-10 refused: '{key}' is stored as BytesStorageMetadata, not a tensor" in line, line
    assert not marker.exists()


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


@pytest.mark.version_specific
def test_checkpoint_metadata_is_never_unpickled_freely(tmp_path, monkeypatch):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"unreadable \.metadata .*unexpected object posix\.system"):
        read_dcp_metadata(tmp_path, "checkpoint")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_export_converts_to_hf_and_initial_weights_load(ref1, tmp_path):
    """The fp32 export, its HF conversion and the DCP checkpoint start a run from the same weights."""
    export = ref1 / "checkpoints" / "final" / "model.safetensors"
    hf = tmp_path / "hf"
    convert = run_script("scripts/convert_weights.py", ["--from", "torch", "--to", "hf", "--flavor", "debug",
                                                         str(export), str(hf)], timeout=120)
    assert convert.returncode == 0, convert.stderr
    assert (hf / "config.json").is_file()

    first = {}
    for fmt, path in (("torch", export), ("hf", hf), ("dcp", ref1 / "checkpoints" / "step-10")):
        dump = tmp_path / fmt
        out = ok(run_train([*BASE, "--training.steps", "1", "--job.dump_folder", str(dump),
                            "--checkpoint.initial_load_path", str(path),
                            "--checkpoint.initial_load_format", fmt]))
        assert f"loaded initial weights ({fmt})" in out
        first[fmt] = losses(dump)[1]
    # The run's last weights score its first batch the same whichever way they are loaded,
    # and far better than the fresh initialisation did.
    assert first["torch"] == first["hf"] == first["dcp"], first
    assert first["torch"] < losses(ref1)[1] - 1.0
