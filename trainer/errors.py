"""User-facing errors: one clear line, exit code 2, no traceback."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


class UserError(Exception):
    """A problem with the user's input (config, data, paths, checkpoints).

    ``train.py`` and the scripts print ``error: <message>`` and exit with code 2.
    The message must be a single line that names the offending key, file or value.
    """

    exit_code = 2


# A rank waits this long for another rank that is printing the line; then it prints too.
LOCK_WAIT_S = 30.0
# Markers of past launches older than this are removed by the next report. A marker is only
# needed until torchrun has stopped the launch's other workers (seconds after the first exit).
MARKER_MAX_AGE_S = 3600.0
MARKER_PREFIX = "f8trainer-error-"


def report(error: UserError) -> None:
    """Print ``error: <message>`` to stderr once per torchrun launch, before returning.

    Under torchrun several ranks may raise (the same) UserError, and torchrun stops every
    worker as soon as one exits: the line must be out before *any* rank leaves. The ranks
    of one launch on this host share a marker file. Whichever rank locks it first and finds
    it empty prints the line and marks it, all under the lock; a rank that finds it marked
    prints nothing; a rank that finds it locked waits for the lock first, so it cannot
    exit (and get the printer stopped) before the line is out. The lock dies with its
    holder, so a printer killed before it marked the file leaves the line to the next rank.
    Run directly (one process), or where no launch identity or lock is available, the
    line is simply printed: never lost, at worst repeated.
    """
    _leave_on_stop_signals()
    line = f"error: {error}"
    path = _marker_path()
    if path is None:
        _print(line)
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        _print(line)
        return
    try:
        locked = _lock(fd)
        if not locked or os.fstat(fd).st_size == 0:
            _print(line)
            os.write(fd, b"printed\n")
    finally:
        os.close(fd)  # releases the lock
    _remove_stale_markers(path)


def _leave_on_stop_signals() -> None:
    """A process reporting its error is leaving: torchrun's SIGTERM (another rank failed first)
    ends it at once, where a handler that raises Interrupted would have broken off the report
    with a traceback."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)


def reported_in_this_launch() -> bool:
    """A worker of this torchrun launch (on this host) has printed its UserError's line."""
    path = _marker_path()
    try:
        return path is not None and path.stat().st_size > 0
    except OSError:
        return False


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _lock(fd: int) -> bool:
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def _marker_path() -> Path | None:
    """The marker shared by the workers of this torchrun launch on this host, or None."""
    key = launch_key()
    if key is None or fcntl is None:
        return None
    return Path(tempfile.gettempdir()) / f"{MARKER_PREFIX}{os.getuid()}-{key}"


def launch_key() -> str | None:
    """Names this torchrun launch (and restart) on this host; None outside torchrun.

    torchrun starts every local worker itself, so they share a parent: the agent. Its
    pid and start time (a reused pid starts later) name the launch; the run id and the
    restart count tell its rendezvous and restarts apart.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    agent = os.getppid()
    parts = [str(agent), process_start_time(agent), run_id, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]


def process_start_time(pid: int) -> str:
    """When `pid` started, in clock ticks since boot (Linux); '' where unknown."""
    try:
        # Field 22 of /proc/<pid>/stat; fields 3.. follow the ')' that ends the command name.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _remove_stale_markers(current: Path) -> None:
    now = time.time()
    for marker in current.parent.glob(f"{MARKER_PREFIX}{os.getuid()}-*"):
        try:
            if marker != current and now - marker.stat().st_mtime > MARKER_MAX_AGE_S:
                marker.unlink()
        except OSError:
            pass
