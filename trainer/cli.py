"""How every command ends: train.py and the scripts share one error handling.

Bad input (a UserError) is one line, `error: <the problem>`, exit 2; Ctrl-C is one line, exit
130; anything unforeseen is one line naming the exception and the file holding its traceback,
exit 1; an exception that ends a background thread (TensorBoard's writer, a library's worker)
is kept for the main thread instead of printed (trainer/threads.py). A script's `__main__` is
`sys.exit(run_command(main))`, and its parser an `ArgParser`, so that a mistake on its command
line is such a line too.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

from trainer.crash import unexpected
from trainer.errors import UserError, report
from trainer.threads import install_thread_excepthook, raise_thread_failure

INTERRUPTED_EXIT = 130


class ArgParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UserErrors: one line under run_command, not argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        raise UserError(message)


class Interrupted(UserError):
    """Ctrl-C, or a SIGTERM/SIGHUP before a run's own handler is installed."""

    exit_code = INTERRUPTED_EXIT


@contextmanager
def interruptible(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While inside, `signals` raise `Interrupted`, so that `finally` blocks run (a lock is released, a
    partial file removed) where their default action would end the process at once. The handlers
    found on entry (SIGINT's too, which a run replaces) are put back on exit."""

    def interrupt(signum: int, frame: object) -> NoReturn:
        raise Interrupted(f"stopped by signal {signal.Signals(signum).name} before the run started; nothing was saved")

    previous = {s: signal.getsignal(s) for s in (*signals, signal.SIGINT)}
    for signum in signals:
        signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_command(main: Callable[[], int | None]) -> int:
    """Run a command's `main` and return its exit code, reporting any failure in one line."""
    install_thread_excepthook()
    try:
        code = main() or 0
        raise_thread_failure()
        return code
    except UserError as e:
        report(e)
        return e.exit_code
    except KeyboardInterrupt:
        report(Interrupted("interrupted (Ctrl-C)"))
        return INTERRUPTED_EXIT
    except Exception as e:
        error = unexpected(e, None)
        report(error)
        return error.exit_code
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
