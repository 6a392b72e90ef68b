"""Checkpoint integrity (issue #11): content checksums written with every save and checked before a
resume, and saves that fail (a full disk) stopping with one line while earlier checkpoints stay usable.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers import run_train
from trainer.checkpoint import checksums
from trainer.checkpoint.folder import checkpoint_bytes, checkpoints_to_hold, format_bytes
from trainer.config import build_config
from trainer.model_setup import build_meta_model, model_args_for

SMALL = [
    "--model.n_layers", "1", "--training.seq_len", "32", "--training.batch_size", "2",
    "--training.mixed_precision_param", "float32", "--metrics.enable_tensorboard", "false",
]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def error_line(proc: subprocess.CompletedProcess, nproc: int = 1) -> str:
    """Exit 2 with exactly one `error:` line and no traceback; returns the line.

    Under torchrun: exit 1 with the worker's 2 in its report, and only torchrun's own traceback.
    """
    assert proc.returncode == (2 if nproc == 1 else 1), f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert proc.stderr.count("Traceback") == (0 if nproc == 1 else 1), proc.stderr[-3000:]
    assert nproc == 1 or "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def warnings_of(proc: subprocess.CompletedProcess) -> list[str]:
    """The run's warnings but the one that these runs of a few steps end inside configs/debug.toml's warmup."""
    return [line for line in proc.stderr.splitlines() if line.startswith("warning:") and "warmup_steps" not in line]


def flip_bits(path: Path, count: int) -> None:
    """Flip `count` bits spread evenly through the file: bit rot, the size unchanged."""
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[len(data) * (2 * i + 1) // (2 * count)] ^= 1 << (i % 8)
    path.write_bytes(bytes(data))


def listing_matches(step: Path) -> None:
    listed = checksums.read(step)
    checksums.check_listing(listed, checksums.list_files(step))
    checksums.check_files(step, listed, sorted(listed))


# -- checksums -------------------------------------------------------------------------------


@pytest.mark.slow
def test_bit_rot_in_a_shard_is_refused_naming_the_file_and_the_older_steps(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT]
    saved = ok(run_train([*args, "--training.steps", "2"])).stdout
    step2 = dump / "checkpoints" / "step-2"
    assert f"checkpoint saved: {step2} (" in saved and ", checksums " in saved
    listed = checksums.read(step2)
    assert {".metadata", "extra.json", "rng/rank-0.safetensors", "__0_0.distcp"} <= set(listed)
    listing_matches(step2)

    flip_bits(step2 / "__0_0.distcp", 49)
    line = error_line(run_train([*args, "--training.steps", "3"]))
    assert line.startswith(f"error: checkpoint {step2}: __0_0.distcp does not match its checksum (crc32 "), line
    assert line.endswith("the file is damaged; resume from an older checkpoint with checkpoint.load_step = 1 "
                         "(older steps: 1)"), line
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["step-1", "step-2"]

    # What the issue saw: without the check the damaged shard loads as if nothing happened.
    unchecked = ok(run_train([*args, "--training.steps", "2", "--checkpoint.verify_checksums", "false"]))
    assert f"checkpoint loaded: {step2} (" in unchecked.stdout and "checksums not verified" in unchecked.stdout

    resumed = ok(run_train([*args, "--training.steps", "3", "--checkpoint.load_step", "1"]))
    assert "resumed from checkpoint at step 1" in resumed.stdout
    assert f"checkpoint loaded: {dump / 'checkpoints' / 'step-1'} (" in resumed.stdout
    assert ", checksums " in resumed.stdout.split("checkpoint loaded:")[1].splitlines()[0]


@pytest.mark.slow
def test_checkpoint_without_checksums_loads_with_one_warning(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT]
    ok(run_train([*args, "--training.steps", "1"]))
    step1 = dump / "checkpoints" / "step-1"
    (step1 / checksums.CHECKSUMS_FILE).unlink()  # as written before checksums existed
    proc = ok(run_train([*args, "--training.steps", "2"]))
    assert "resumed from checkpoint at step 1" in proc.stdout
    # Besides the one on training.steps, changed since the checkpoint.
    assert [w for w in warnings_of(proc) if "training.steps" not in w] == [
        f"warning: checkpoint {step1} has no checksums.json (written before checksums existed or with "
        "checkpoint.verify_checksums = false): its files are loaded unverified"
    ]
    listing_matches(dump / "checkpoints" / "step-2")


def test_listing_refuses_missing_added_truncated_and_damaged_files(tmp_path):
    (tmp_path / "rng").mkdir()
    for name, size in (("a.distcp", 20 << 20), ("rng/rank-0.safetensors", 10), (".metadata", 0)):
        (tmp_path / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    names = checksums.list_files(tmp_path)
    assert names == [".metadata", "a.distcp", "rng/rank-0.safetensors"]
    checksums.write(tmp_path, checksums.describe(tmp_path, names))
    assert checksums.list_files(tmp_path) == names  # checksums.json lists the others, not itself
    listed = checksums.read(tmp_path)
    checksums.check_files(tmp_path, listed, names)

    with pytest.raises(checksums.ChecksumError, match=r"^evil\.bin is not listed in checksums\.json"):
        checksums.check_listing(listed, [*names, "evil.bin"])
    with pytest.raises(checksums.ChecksumError, match=r"^a\.distcp is missing \(checksums\.json lists it\)$"):
        checksums.check_listing(listed, names[:1] + names[2:])
    flip_bits(tmp_path / "a.distcp", 1)
    with pytest.raises(checksums.ChecksumError, match=r"^a\.distcp does not match its checksum \(crc32 "):
        checksums.check_files(tmp_path, listed, names)
    with (tmp_path / "a.distcp").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(checksums.ChecksumError, match=r"^a\.distcp is 100 bytes, checksums\.json lists 20971520 "):
        checksums.check_files(tmp_path, listed, names)
    (tmp_path / checksums.CHECKSUMS_FILE).write_text(json.dumps({"algorithm": "crc32", "files": {"a": 1}}))
    with pytest.raises(checksums.ChecksumError, match=r"^checksums\.json is damaged"):
        checksums.read(tmp_path)


@pytest.mark.slow
def test_two_ranks_list_every_rank_s_files_and_stop_together_on_damage(tmp_path):
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, *CKPT, "--checkpoint.async_mode", "async"]
    ok(run_train([*args, "--training.steps", "2"], nproc=2))
    for step in ("step-1", "step-2"):
        folder = dump / "checkpoints" / step
        assert {"rng/rank-0.safetensors", "rng/rank-1.safetensors", "__0_0.distcp", "__1_0.distcp"} \
            <= set(checksums.read(folder))
        listing_matches(folder)
    # The ranks check the listed files in turns: rank 1 checks the second, __0_0.distcp.
    step2 = dump / "checkpoints" / "step-2"
    assert sorted(checksums.read(step2))[1] == "__0_0.distcp"
    flip_bits(step2 / "__0_0.distcp", 49)
    line = error_line(run_train([*args, "--training.steps", "3"], nproc=2, launcher="torchrun"), nproc=2)
    assert line.startswith(f"error: checkpoint {step2}: __0_0.distcp does not match its checksum"), line
    assert line.endswith("checkpoint.load_step = 1 (older steps: 1)"), line


# -- disk space and failed saves -------------------------------------------------------------


def test_disk_space_estimate_counts_the_checkpoints_held_at_once():
    assert checkpoints_to_hold(saves=10, keep_latest_k=0, existing=3) == 10
    assert checkpoints_to_hold(saves=10, keep_latest_k=2, existing=0) == 3
    assert checkpoints_to_hold(saves=10, keep_latest_k=2, existing=2) == 1
    assert checkpoints_to_hold(saves=1, keep_latest_k=3, existing=0) == 1
    assert checkpoints_to_hold(saves=0, keep_latest_k=3, existing=0) == 0
    assert [format_bytes(n) for n in (512, 3 << 20, 5 << 30)] == ["512 B", "3.0 MiB", "5.0 GiB"]


def one_checkpoint() -> int:
    """The estimated size of one checkpoint of SMALL (fp32 weights and two AdamW moments)."""
    return checkpoint_bytes(build_meta_model(model_args_for(build_config(SMALL), None, "cpu")))


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5-checkpoint tmpfs (root only), grown by calling the returned function with a size."""
    disk = tmp_path / "disk"
    disk.mkdir()
    one = one_checkpoint()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={one * 3 // 2}", "tmpfs", str(disk)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip()}")

    def grow(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)

    yield disk, grow
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_full_disk_stops_with_one_line_and_the_rerun_resumes(tmp_path, small_disk, async_mode):
    disk, grow = small_disk
    args = ["--job.dump_folder", str(tmp_path / "run"), *SMALL, *CKPT, "--checkpoint.folder", str(disk),
            "--checkpoint.keep_latest_k", "1", "--checkpoint.async_mode", async_mode, "--training.steps", "3"]
    proc = run_train(args)
    line = error_line(proc)
    assert line.startswith(f"error: checkpoint step-2 could not be written to {disk / 'step-2.partial'} ("), line
    one = one_checkpoint()
    assert (f"free, a checkpoint needs about {format_bytes(one)}; the incomplete checkpoint was removed and "
            "step-1 is the latest complete one") in line, line
    (warning,) = warnings_of(proc)
    assert warning.startswith(f"warning: checkpoint folder {disk} has "), warning
    assert (f" free, but this run's checkpoints need about {format_bytes(2 * one)} (2 x {format_bytes(one)}; "
            "keep_latest_k = 1 holds 2 while saving)") in warning, warning
    assert sorted(p.name for p in disk.iterdir()) == ["step-1"]
    listing_matches(disk / "step-1")

    # Space freed; a save killed mid-way left a partial folder too: the rerun needs no cleanup.
    grow(64 << 20)
    (disk / "step-2.partial").mkdir()
    (disk / "step-2.partial" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    rerun = ok(run_train(args))
    assert f"removed the unfinished checkpoint {disk / 'step-2.partial'}" in rerun.stdout
    assert "resumed from checkpoint at step 1" in rerun.stdout
    assert sorted(p.name for p in disk.iterdir()) == ["step-3"]
    assert not warnings_of(rerun)
