"""Exceptions that end background threads, kept for the main thread instead of printed."""

from __future__ import annotations

import threading

_thread_failures: list[tuple[str, BaseException]] = []


def install_thread_excepthook() -> None:
    """Keep an exception that ends a background thread (ours or a library's, such as TensorBoard's
    writer) for the main thread, instead of the ~50 lines Python prints for it by default.

    The main thread raises it at its next check (`raise_thread_failure`), which turns it into the
    run's one line like any unexpected failure.
    """

    def keep(hook_args: threading.ExceptHookArgs) -> None:
        if hook_args.exc_type is SystemExit or hook_args.exc_value is None:
            return
        name = hook_args.thread.name if hook_args.thread is not None else "a thread"
        _thread_failures.append((name, hook_args.exc_value))

    _thread_failures.clear()  # a thread that died before belongs to no command of this process
    threading.excepthook = keep


class ThreadFailure(RuntimeError):
    """A background thread died of an exception; the message names the thread and the exception."""


def raise_thread_failure() -> None:
    """Raise the first exception that ended a background thread, if any did."""
    if _thread_failures:
        name, error = _thread_failures[0]
        _thread_failures.clear()  # reported once: the next command of this process starts clean
        lines = str(error).strip().splitlines()
        raise ThreadFailure(f"in thread {name}: {type(error).__name__}: {lines[0] if lines else ''}") from error
