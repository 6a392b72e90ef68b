"""The dump folder: writable before any work, owned by one run at a time, earlier runs' records kept
(and the scripts' rules for an output that exists: benchmarks keep earlier results, generators refuse).

``<dump>/.lock`` names the run that owns the folder (host, pid, start time). It is created
complete or not at all (written aside, then hard-linked into place, which fails if a lock
exists), so a reader never sees half a lock. A lock whose process is gone from this host
is stale: the next run takes it over with a warning. A lock of another host cannot be
checked from here, so it is always treated as live.

The checkpoint folder is the run's too: outside the dump folder it gets a lock of its own,
and it may not lie in a folder that another live run has locked, so a second run can neither
resume nor clean up (``step-N.partial``) checkpoints that a live run is writing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainer.checkpoint.dcp_reader import describe_error
from trainer.errors import UserError, process_start_time
from trainer.launch import launch_rank
from trainer.log import info, warn
from trainer.records import set_aside

LOCK_NAME = ".lock"
# What a fresh run moves into previous-N/ so that it never overwrites an earlier run's records.
RECORDS = ("metrics.jsonl", "tb", "config.toml", "wandb_id", "wandb")


def check_writable(folder: Path, option: str = "job.dump_folder") -> None:
    """Create `folder` (and missing parents) and a probe file in it, or raise a one-line UserError naming `option`."""
    probe = folder / f".probe-{socket.gethostname()}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{option} '{folder}' is not a writable folder ({describe_error(e)})") from None


def _checkpoint_around(folder: Path) -> Path | None:
    """The checkpoint (a DCP folder, or one with checksums.json) that `folder` is or lies in, if any."""
    for place in [folder, *folder.parents]:
        if (place / ".metadata").is_file() or (place / "checksums.json").is_file():
            return place
    return None


def check_own_folder(folder: Path) -> None:
    """Refuse a dump folder that is not a folder of its own: the current folder or one above it (a fresh
    run would move the user's config.toml into previous-N/), a checkpoint or a folder in one (its
    checksums would no longer match)."""
    cwd = Path.cwd().resolve()
    if inside(cwd, folder):
        raise UserError(f"job.dump_folder '{folder}' is the current folder or holds it: a fresh run moves "
                        "config.toml, metrics.jsonl and tb/ found there into previous-N/; give the run a folder "
                        "of its own, such as outputs/<name>")
    checkpoint = _checkpoint_around(folder.resolve())
    if checkpoint is not None:
        raise UserError(f"job.dump_folder '{folder}' lies in the checkpoint {checkpoint}: files written there would "
                        "make it unloadable (they are not in its checksums.json); use a folder outside it")


def _owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "proc_start": process_start_time(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def _is_stale(owner: Any) -> bool:
    """The lock's process is gone from this host (or the lock is unreadable, a writer killed mid-way)."""
    if not isinstance(owner, dict) or type(owner.get("pid")) is not int:
        return True
    if owner.get("host") != socket.gethostname():
        return False
    try:
        os.kill(owner["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's
    # A reused pid belongs to a process started later than the lock's owner.
    return bool(owner.get("proc_start")) and process_start_time(owner["pid"]) != owner["proc_start"]


def _read_owner(lock: Path) -> Any:
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return None


def _in_use(option: str, folder: Path, owner: dict[str, Any], lock: Path) -> UserError:
    where = f"'{folder}'" if lock.parent == folder else f"'{folder}' lies in {lock.parent}, which"
    return UserError(
        f"{option} {where} is in use by another run (pid {owner['pid']} on {owner.get('host')}, started "
        f"{owner.get('started')}); wait for it, use another {option}, or delete {lock} if that run is gone"
    )


def _live_foreign_owner(lock: Path) -> dict[str, Any] | None:
    """The owner of `lock` when it is another process that is still alive (or on another host)."""
    owner = _read_owner(lock)  # None when there is no lock
    if _is_stale(owner) or (owner["pid"] == os.getpid() and owner.get("host") == socket.gethostname()):
        return None
    return owner


def check_not_locked_by_another_run(folder: Path, option: str, within: Path | None = None) -> None:
    """Refuse `folder` when it, or a folder it lies in (below `within`, when given), is locked by another live run."""
    places = [folder, *folder.parents]
    if within is not None:
        places = [p for p in places if inside(p, within) and p.resolve() != within.resolve()]
    for place in places:
        owner = _live_foreign_owner(place / LOCK_NAME)
        if owner is not None:
            raise _in_use(option, folder, owner, place / LOCK_NAME)


def acquire_lock(folder: Path, option: str = "job.dump_folder") -> Path:
    """Take ``<folder>/.lock`` for this process; a one-line UserError naming `option` when another live run holds it."""
    lock = folder / LOCK_NAME
    mine = _owner()
    aside = folder / f"{LOCK_NAME}.{mine['host']}.{mine['pid']}"
    aside.write_text(json.dumps(mine))
    try:
        while True:
            try:
                os.link(aside, lock)
                return lock
            except FileExistsError:
                pass
            owner = _read_owner(lock)
            if not _is_stale(owner):
                raise _in_use(option, folder, owner, lock)
            warn(f"taking over the stale lock {lock} of a run that is gone ({_describe(owner)})")
            # Only the stale lock we read is removed: a run that took it over meanwhile keeps its own.
            if _read_owner(lock) == owner:
                lock.unlink(missing_ok=True)
    finally:
        aside.unlink(missing_ok=True)


def _describe(owner: Any) -> str:
    if not isinstance(owner, dict):
        return "unreadable lock file"
    return f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}"


def release_lock(lock: Path) -> None:
    """Remove the lock if this process still owns it."""
    owner = _read_owner(lock)
    if isinstance(owner, dict) and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
        lock.unlink(missing_ok=True)


def inside(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies in it (links resolved)."""
    return path.resolve() == folder.resolve() or folder.resolve() in path.resolve().parents


@contextmanager
def claim(folder: str, checkpoint_folder: Path | None = None) -> Iterator[None]:
    """The dump folder (and the checkpoint folder, when the run uses one) for one run: checked
    writable on every rank, locked by rank 0 until the run ends.

    Entered before the model is built, so an unusable or busy folder costs nothing. A checkpoint
    folder inside the dump folder is covered by the dump folder's lock; one outside gets its own.
    Either way it may not be, or lie in, a folder another live run holds.
    """
    path = Path(folder)
    check_own_folder(path)
    check_writable(path)
    outside = checkpoint_folder is not None and not inside(checkpoint_folder, path)
    if outside:
        check_writable(checkpoint_folder, "checkpoint.folder")
    locks: list[Path] = []
    try:
        if launch_rank() == 0:
            # Also a folder above it: a live run's dump or checkpoint folder.
            check_not_locked_by_another_run(path, "job.dump_folder")
            locks.append(acquire_lock(path))
            if checkpoint_folder is not None:
                # Outside: it may lie in another live run's dump folder. Inside: another run may
                # have taken it as its (outside) checkpoint folder.
                check_not_locked_by_another_run(checkpoint_folder, "checkpoint.folder", None if outside else path)
            if outside:
                locks.append(acquire_lock(checkpoint_folder, "checkpoint.folder"))
        yield
    finally:
        for lock in reversed(locks):
            release_lock(lock)


def move_previous_records(folder: Path) -> Path | None:
    """Move an earlier run's metrics.jsonl, tb/ and config.toml into ``previous-N/`` (N = 1, 2, ...).

    Returns the folder they went to, or None when there was nothing to keep.
    """
    return set_aside(folder, [folder / name for name in RECORDS], copy=False)


def keep_earlier_results(folder: Path, names: Iterable[str]) -> Path | None:
    """A benchmark's rule for its --out folder: check that it is a writable folder, then move the
    entries `names` of it that exist into ``previous-N/``, as a fresh run keeps an earlier run's
    records, and say so in one line.

    Called before any new result is written, so a run that fails leaves the earlier results intact.
    Returns the folder they went to, or None when there was nothing to keep.
    """
    check_writable(folder, "--out")
    present = [folder / name for name in dict.fromkeys(names) if (folder / name).exists()]
    target = set_aside(folder, present, copy=False)
    if target is not None:
        info(f"kept the earlier {', '.join(p.name for p in present)} in {target}/")
    return target


def refuse_to_overwrite(paths: Iterable[Path], flag: str = "--force") -> None:
    """A generator's rule for its outputs: a UserError naming the first of `paths` that exists, unless
    the user passed `flag`."""
    for path in paths:
        if path.exists():
            raise UserError(f"{path} exists; pass {flag} to overwrite it, or choose another --out")


def keep_records(folder: Path, resumed: bool, rolled_back: bool) -> None:
    """Before a run writes its records: a fresh run moves an earlier run's aside; a rollback
    (checkpoint.load_step) copies the replaced run's, whose metrics past the resumed step are cut."""
    if not resumed:
        kept = move_previous_records(folder)
        if kept is not None:
            info(f"the previous run's records in {folder} were moved to {kept}")
    elif rolled_back:
        kept = set_aside(folder, [folder / name for name in RECORDS], copy=True)
        if kept is not None:
            info(f"the replaced run's records in {folder} were copied to {kept}")


def deleted(folder: Path, step: int, saved: str) -> UserError:
    """The line for a dump folder deleted (or replaced) during the run."""
    return UserError(f"job.dump_folder '{folder}' was deleted or replaced during the run (noticed after step {step}): "
                     f"its metrics.jsonl, config.toml and .lock are gone; {saved}")


class FolderWatch:
    """Notices that a folder a run writes into was deleted, or replaced by another of its name.

    Files opened in a deleted folder still take writes, which go nowhere: without this, a run
    whose dump folder was removed would finish with every record lost and exit 0.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._identity = self._stat()

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.folder)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def gone(self) -> bool:
        return self._stat() != self._identity
