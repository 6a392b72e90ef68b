"""Checkpoints end to end: exact resume (1 process, FSDP=2, across dp degrees), atomic saves,
signals, async saves, keep_latest_k, load_step, damaged checkpoints, export and initial weights.

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
from types import SimpleNamespace

import pytest

from tests.helpers import ROOT, free_port, read_metrics, run_train
from trainer.checkpoint import CheckpointManager
from trainer.config import build_config
from trainer.errors import UserError
from trainer.weights import read_dcp_metadata

# warmup_steps = 10 makes the learning rate of steps 1..10 independent of training.steps, so
# a 10-step first leg and a 20-step run see the same schedule there.
BASE = [
    "--training.batch_size", "4", "--training.seq_len", "64", "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "10",
    "--checkpoint.enable", "true", "--checkpoint.interval", "100",
]


def losses(folder: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (re-run after a resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in read_metrics(folder)}


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
    """20 steps, 1 process; async saves every 5 steps, keep 2; fp32 export at the end."""
    out = tmp_path_factory.mktemp("ref1")
    ok(run_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(out),
                  "--checkpoint.interval", "5", "--checkpoint.async_mode", "async",
                  "--checkpoint.keep_latest_k", "2", "--checkpoint.export_final", "true",
                  "--checkpoint.export_dtype", "float32"]))
    return out


@pytest.fixture(scope="module")
def ref2(tmp_path_factory) -> Path:
    """20 steps, FSDP over 2 processes (global batch 8)."""
    out = tmp_path_factory.mktemp("ref2")
    ok(run_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(out)], nproc=2))
    return out


def test_async_saves_keep_latest_k_and_export(ref1):
    assert checkpoints(ref1) == ["final", "step-15", "step-20"]
    assert len(losses(ref1)) == 20
    assert (ref1 / "checkpoints" / "final" / "model.safetensors").is_file()
    extra = json.loads((ref1 / "checkpoints" / "step-20" / "extra.json").read_text())
    assert extra["train_state"]["step"] == 20 and extra["global_batch"] == 4


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_saves_and_resume_is_bitwise(ref1, ref2, tmp_path, nproc):
    """SIGTERM (to the worker processes under torchrun) -> finish the step, save, exit 0; resume is exact."""
    ref = ref1 if nproc == 1 else ref2
    log = tmp_path / "leg1.log"
    proc = start_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(tmp_path)], log, nproc)
    wait_for(lambda: "step      3/20" in log.read_text(), proc)
    for pid in [proc.pid] if nproc == 1 else workers(proc):
        os.kill(pid, signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "received signal 15" in text and "on request; checkpoint saved" in text
    (stopped,) = [int(n.removeprefix("step-")) for n in checkpoints(tmp_path)]
    assert 3 <= stopped < 20
    out = ok(run_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(tmp_path)], nproc=nproc))
    assert f"resumed from checkpoint at step {stopped}" in out
    assert losses(tmp_path) == losses(ref)


def test_load_step_resumes_an_older_async_checkpoint(ref1, tmp_path):
    shutil.copytree(ref1 / "checkpoints", tmp_path / "checkpoints")
    out = ok(run_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(tmp_path),
                        "--checkpoint.load_step", "15"]))
    assert "resumed from checkpoint at step 15" in out
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(16, 21))
    assert all(resumed[s] == losses(ref1)[s] for s in resumed)


def test_kill9_during_save_leaves_previous_checkpoint(ref1, tmp_path):
    """SIGKILL while step-N.partial is being written: step-(N-1) stays the latest and resumes exactly."""
    folder = tmp_path / "checkpoints"
    args = [*BASE, "--training.steps", "20", "--job.dump_folder", str(tmp_path),
            "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "3"]
    for _ in range(3):  # the save may finish between seeing the folder and the kill; try again then
        shutil.rmtree(tmp_path, ignore_errors=True)
        tmp_path.mkdir()
        proc = start_train(args, tmp_path / "leg1.log")

        def partial_seen() -> bool:
            return folder.is_dir() and any(p.name.endswith(".partial") and int(p.name[5:-8]) >= 4
                                           for p in folder.iterdir())

        wait_for(partial_seen, proc, poll=0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        names = os.listdir(folder)
        if any(n.endswith(".partial") for n in names):
            break
    else:
        pytest.skip("could not catch a save in progress")
    (partial,) = [n for n in names if n.endswith(".partial")]
    complete = sorted(int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit())
    assert complete and max(complete) < int(partial[5:-8])
    out = ok(run_train(args))
    assert f"resumed from checkpoint at step {max(complete)}" in out
    assert losses(tmp_path) == losses(ref1)
    assert not [n for n in os.listdir(folder) if not n.startswith("step-") or not n[5:].isdigit()]


def test_resume_on_another_dp_degree(ref2, tmp_path):
    """dp=1 x batch 8 -> dp=2 x batch 4 continues the same run; another global batch is refused."""
    leg1 = [*BASE, "--training.batch_size", "8", "--training.steps", "10", "--job.dump_folder", str(tmp_path)]
    ok(run_train(leg1))
    ref = losses(ref2)
    for step, loss in losses(tmp_path).items():  # dp=1 and dp=2 compute the same steps
        assert math.isclose(loss, ref[step], rel_tol=2e-3), (step, loss, ref[step])

    line = one_error_line(run_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(tmp_path)]))
    assert "global batch of 8" in line and "uses 4" in line

    out = ok(run_train([*BASE, "--training.steps", "20", "--job.dump_folder", str(tmp_path)], nproc=2))
    assert "resumed from checkpoint at step 10" in out
    resumed = losses(tmp_path)
    assert sorted(resumed) == list(range(1, 21))
    for step in range(11, 21):
        assert math.isclose(resumed[step], ref[step], rel_tol=2e-3), (step, resumed[step], ref[step])


def _damage_layers(step: Path) -> list[str]:
    return ["--model.n_layers", "2"]


def _damage_truncate(step: Path) -> list[str]:
    (shard,) = step.glob("*.distcp")
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    return []


def _damage_extra(step: Path) -> list[str]:
    (step / "extra.json").unlink()
    return []


@pytest.mark.parametrize(("damage", "expected"), [
    (_damage_layers, "has 18 weights this model lacks, e.g. 'layers.2."),
    (_damage_truncate, "cannot be loaded"),
    (_damage_extra, "extra.json is missing"),
])
def test_bad_checkpoint_is_one_line_exit_2(ref1, tmp_path, damage, expected):
    step = tmp_path / "checkpoints" / "step-20"
    shutil.copytree(ref1 / "checkpoints" / "step-20", step)
    extra_args = damage(step)
    line = one_error_line(run_train([*BASE, "--training.steps", "25", "--job.dump_folder", str(tmp_path), *extra_args]))
    assert expected in line and "step-20" in line


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_checkpoint_metadata_is_never_unpickled_freely(tmp_path, monkeypatch):
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Payload()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"unreadable \.metadata .*unexpected object posix\.system"):
        read_dcp_metadata(tmp_path, "checkpoint")
    assert not (tmp_path / "pwned").exists()


def test_load_step_that_does_not_exist(tmp_path):
    (tmp_path / "checkpoints" / "step-5").mkdir(parents=True)
    cfg = build_config(["--job.dump_folder", str(tmp_path), "--checkpoint.enable", "true",
                        "--checkpoint.load_step", "7"])
    manager = CheckpointManager(SimpleNamespace(cfg=cfg))
    with pytest.raises(UserError, match=r"load_step = 7: no such checkpoint .* \(found: 5\)"):
        manager.load_latest()


def test_export_converts_to_hf_and_initial_weights_load(ref1, tmp_path):
    """The fp32 export, its HF conversion and the DCP checkpoint start a run from the same weights."""
    export = ref1 / "checkpoints" / "final" / "model.safetensors"
    hf = tmp_path / "hf"
    convert = subprocess.run(
        [sys.executable, "scripts/convert_weights.py", "--from", "torch", "--to", "hf", "--flavor", "debug",
         str(export), str(hf)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert convert.returncode == 0, convert.stderr
    assert (hf / "config.json").is_file()

    first = {}
    for fmt, path in (("torch", export), ("hf", hf), ("dcp", ref1 / "checkpoints" / "step-20")):
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
