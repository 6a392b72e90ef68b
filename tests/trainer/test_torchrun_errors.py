"""A UserError under torchrun: the one `error:` line appears exactly once, whichever rank
raises it and whichever rank finishes first (torchrun stops the others as soon as one exits).

The order is forced with tests/wrappers/train_hooked.py (test-only hooks around train.py), so each
case is deterministic rather than a race that only load uncovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT, run_train

LAYOUT_ERROR = "error: parallelism.tensor_parallel_degree = 4 does not divide the world size 2"


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def run_hooked(tmp_path, args: list[str], hooks: dict) -> subprocess.CompletedProcess:
    hooks_dir = tmp_path / "hooks"
    hooks_dir.mkdir()
    # TMPDIR: the ranks' shared marker (and torchrun's logs) stay in this test's folder.
    env = {"TRAIN_HOOKS": json.dumps(hooks), "TRAIN_HOOKS_DIR": str(hooks_dir), "TMPDIR": str(tmp_path)}
    return run_train([*args, "--job.dump_folder", str(tmp_path / "out")], nproc=2, env=env,
                     script="tests/wrappers/train_hooked.py")


def assert_one_line(proc: subprocess.CompletedProcess, expected: str) -> None:
    # torchrun exits 1 for any failed worker; its report gives the worker's own code (2).
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    assert error_lines(proc) == [expected], proc.stderr[-4000:]
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-4000:]
    # No worker traceback (e.g. a rank left failing in a collective): only torchrun's own.
    assert proc.stderr.count("Traceback") == 1, proc.stderr[-4000:]


@pytest.mark.slow
def test_layout_error_printed_when_rank_1_exits_first(tmp_path):
    # Rank 0 starts only once rank 1 has failed and gone: torchrun stops it before it
    # gets anywhere, so the line must come from rank 1.
    proc = run_hooked(tmp_path, ["--parallelism.tensor_parallel_degree", "4"], {"0": {"start_after_exit_of": 1}})
    assert_one_line(proc, LAYOUT_ERROR)


@pytest.mark.slow
def test_layout_error_printed_when_the_printer_is_slow(tmp_path):
    # Rank 0 gets to print first, then stalls; rank 1 hits the same error meanwhile. Rank 1
    # must neither print a second line nor exit (and get rank 0 stopped) before rank 0 printed.
    hooks = {"0": {"hold_error_line_s": 8}, "1": {"start_after_printing_of": 0}}
    proc = run_hooked(tmp_path, ["--parallelism.tensor_parallel_degree", "4"], hooks)
    assert_one_line(proc, LAYOUT_ERROR)


@pytest.mark.slow
def test_checkpoint_error_after_the_process_group_exists(tmp_path):
    # Every rank raises after init_process_group; rank 0's line, if it gets to print, stalls.
    args = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.batch_size", "2",
            "--checkpoint.enable", "true", "--checkpoint.load_step", "5"]
    proc = run_hooked(tmp_path, args, {"0": {"hold_error_line_s": 8}})
    folder = tmp_path / "out" / "checkpoints"
    assert_one_line(proc, f"error: checkpoint.load_step = 5: no such checkpoint in {folder} (found: none)")


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1])
def test_error_on_one_rank_only(tmp_path, rank):
    # A data problem seen by one rank only, mid-run: the other rank waits in a collective.
    args = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.batch_size", "2",
            "--metrics.enable_tensorboard", "false"]
    proc = run_hooked(tmp_path, args, {str(rank): {"raise_at_first_batch": f"bad row seen by rank {rank}"}})
    assert_one_line(proc, f"error: step 1: bad row seen by rank {rank}")


REPORTER = textwrap.dedent("""
    import sys, time
    from trainer.errors import UserError, report
    time.sleep(float(sys.argv[1]))
    report(UserError("same problem"))
""")


def test_report_prints_once_per_launch(tmp_path, monkeypatch):
    """Workers with one parent and one TORCHELASTIC_RUN_ID print the line once between them;
    another launch (run id) prints its own; a plain process always prints."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))

    def launch(run_id: str | None, n: int) -> list[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        if run_id is not None:
            env.update(TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0")
        procs = [subprocess.Popen([sys.executable, "-c", REPORTER, str(0.05 * (i % 2))], cwd=ROOT, env=env,
                                  stderr=subprocess.PIPE, text=True) for i in range(n)]
        return [line for p in procs for line in p.communicate(timeout=120)[1].splitlines()]

    assert launch("run-a", 4) == ["error: same problem"]
    assert launch("run-b", 4) == ["error: same problem"]
    # Later workers of a launch whose printer has exited stay silent too.
    assert launch("run-a", 2) == []
    assert launch(None, 2) == ["error: same problem"] * 2


STOPPED_WHILE_REPORTING = textwrap.dedent("""
    import os, signal
    from trainer import errors
    def interrupt(signum, frame):  # as trainer.cli.interruptible's handler (which imports torch)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    # torchrun's SIGTERM arrives while the rank is still reporting its own error.
    errors._remove_stale_markers = lambda path: os.kill(os.getpid(), signal.SIGTERM)
    errors.report(errors.UserError("checkpoint damaged"))
    print("not reached")
""")


def test_a_sigterm_while_reporting_ends_the_rank_without_a_traceback(tmp_path):
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_RESTART_COUNT": "0", "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", STOPPED_WHILE_REPORTING], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr, proc.stdout) == (-signal.SIGTERM, "error: checkpoint damaged\n", "")
