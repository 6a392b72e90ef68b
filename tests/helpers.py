"""Run train.py / scripts as a user would, in a subprocess, from the repo root."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(
    args: list[str], nproc: int = 1, timeout: int = 300, env: dict | None = None, script: str = "train.py",
    launcher: str = "fork",
) -> subprocess.CompletedProcess:
    """`script` (train.py, a test wrapper of it, or a command in scripts/) with `args` in `nproc` processes.

    The ranks are forked from a server that has imported torch and the project, with torchrun's
    environment, unless `launcher` is "torchrun" (for tests of torchrun's own behaviour) or `env`
    sets a variable (one read at import time, say) to another value than the server started with.
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for name in _LAUNCH_ENV:
        full_env.pop(name, None)
    if launcher == "fork" and _forkable(env or {}):
        return _run_forked(script, args, nproc, timeout, full_env)
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", script, *args,
        ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


def run_script(script: str, args: list[str], timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` from the repository root, forked as run_train forks train.py."""
    return run_train(args, timeout=timeout, env=env, script=script)


# Runs of train.py, its test wrappers and the commands in scripts/ are forked from a server process
# that has imported torch and the project once per test worker, instead of new interpreters
# (torchrun's agent and each rank) paying ~5-8 s of imports each on 2 cores. The server never runs a test or a torch op, so each fork starts as
# clean as a new process; runs whose environment differs from the server's (variables read at
# import time) take real processes. Ranks get the environment torchrun gives its workers, and,
# as under torchrun, the first rank to fail brings the others down.
def _torchrun_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun tells worker `rank` of a one-host launch of `nproc`."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0"}


_LAUNCH_ENV = tuple(_torchrun_env(0, 1, 0, ""))
# Variables a fork may set freely: read after the imports (the thread count, the launch, the
# wrappers' instructions in tests/wrappers/, which they read when they start).
_IMPORT_TIME_ENV_IGNORED = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", *_LAUNCH_ENV,
                            "CRASH", "NONFINITE_ATTEMPTS", "TRAIN_HOOKS", "TRAIN_HOOKS_DIR"}
# The environment before any test changed it (this module is imported at collection): the
# server starts with it whichever test first needs it, so a variable one test sets does not
# send every later run of the worker to real processes.
_SERVER_ENV = dict(os.environ)
_server_started = False
# How long the other ranks get to stop on SIGTERM after one failed, as torchrun's agent gives them.
_STOP_GRACE_S = 30


# What a run would import lazily, imported once in the server: the project's every module and the
# torch modules it defers (dynamo alone is 4 s at a model's first init on 2 busy cores), which cut
# a forked 2-step run from 6.8 s to 2.4 s. The server skips a module that fails to import (Triton's
# kernels without Triton); the run that needs it imports it and fails as it would anyway.
_PRELOAD = [
    "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "torch.utils.tensorboard", "train",
    *sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for package in ("models", "float8", "trainer", "scripts") for path in (ROOT / package).rglob("*.py")),
]


def _forkserver() -> multiprocessing.context.BaseContext:
    global _server_started
    context = multiprocessing.get_context("forkserver")
    if not _server_started:
        context.set_forkserver_preload(_PRELOAD)
        test_env = dict(os.environ)
        os.environ.clear()
        os.environ.update(_SERVER_ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(test_env)
        _server_started = True
    return context


def _forkable(env: dict[str, str]) -> bool:
    """Whether a run given `env` may fork: what a test passes is compared, not the whole
    environment, which libraries change as they load (torch's profiler sets KINETO_LOG_LEVEL in
    the first test that imports it; before, every later run of that worker took real processes).
    The fork still runs with the whole environment. With a GPU, runs take real processes: a forked
    child cannot use CUDA once its parent touched it, and importing the preloaded modules does."""
    if torch.cuda.is_available():
        return False
    return all(_SERVER_ENV.get(k) == v for k, v in env.items() if k not in _IMPORT_TIME_ENV_IGNORED)


def _script_main_in_fork(script: str, args: list[str], env: dict[str, str], stdout: str, stderr: str) -> None:
    """What `python SCRIPT ARGS` does, in a forked child: the script runs as __main__ and its exit code
    (SystemExit's, or 0) is the process's. Its folder is not put first on sys.path (no script imports
    from its own folder; the project is importable from the root). The child leaves through os._exit,
    as train.py always does: no interpreter teardown."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
    path = str(ROOT / script)
    sys.argv = [script, *args]
    multiprocessing.set_start_method(None, force=True)  # a new process's default, not the server's
    faulthandler.register(_DUMP_STACKS, all_threads=True)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # SystemExit("text"): the interpreter prints the text and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# A run that outlives its timeout prints every thread's Python stack to its stderr before it is
# killed: where it hung is then in the test's report.
_DUMP_STACKS = signal.SIGUSR1


def _dump_stacks(ranks: list[multiprocessing.process.BaseProcess]) -> None:
    for rank in ranks:
        if rank.is_alive():
            os.kill(rank.pid, _DUMP_STACKS)
    time.sleep(1)


def _run_forked(script: str, args: list[str], nproc: int, timeout: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    context = _forkserver()
    port, run_id = free_port(), uuid.uuid4().hex
    cmd = [sys.executable, script, *args]
    with tempfile.NamedTemporaryFile("r") as out, tempfile.NamedTemporaryFile("r") as err:
        ranks = [context.Process(target=_script_main_in_fork,
                                 args=(script, args, env if nproc == 1 else {**env, **_torchrun_env(rank, nproc, port, run_id)},
                                       out.name, err.name))
                 for rank in range(nproc)]
        for rank in ranks:
            rank.start()
        deadline = time.monotonic() + timeout
        failed = False
        while any(r.is_alive() for r in ranks) and not failed:
            left = deadline - time.monotonic()
            if left <= 0:
                _dump_stacks(ranks)
                for rank in ranks:
                    rank.kill()
                    rank.join()
                output, errors = out.read(), err.read()
                print(f"the run timed out after {timeout} s; its stderr's end:\n{errors[-20000:]}", file=sys.stderr)
                raise subprocess.TimeoutExpired(cmd, timeout, output, errors)
            # Woken every few seconds to look again: a CI run once slept here until its deadline (300 s) with both
            # ranks already gone and reaped (2026-12-05, torch 2.11 job), then passed.
            multiprocessing.connection.wait([r.sentinel for r in ranks if r.is_alive()], min(left, 5.0))
            failed = any(r.exitcode not in (None, 0) for r in ranks)
        if failed:
            for rank in ranks:
                if rank.is_alive():
                    rank.terminate()
            for rank in ranks:
                rank.join(_STOP_GRACE_S)
                if rank.is_alive():
                    rank.kill()
                    rank.join()
        codes = [r.exitcode for r in ranks]
        code = codes[0] if nproc == 1 else int(any(codes))  # torchrun exits 1 for any failed worker
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())


def assert_compiles_for_hopper(code: str) -> None:
    """Run `code`, which compiles Triton kernels for sm_90 and prints "compiled", in a new interpreter
    without TRITON_INTERPRET: Triton's own compiler passes and ptxas, no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def train_in_process(cfg):
    """Train `cfg` in this process as train.py would, and return the Trainer; the signal handlers
    and torchrun's environment (RANK, MASTER_PORT, ...) the run installs are put back after it, so
    later tests and train.py subprocesses do not inherit them."""
    import signal

    from trainer import run_folder
    from trainer.distributed import process_group
    from trainer.trainer import Trainer

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    environment = dict(os.environ)
    try:
        with run_folder.claim(cfg.job.dump_folder):
            trainer = Trainer(cfg)
            trainer.train()
    finally:
        process_group.shutdown(clean=True)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        os.environ.clear()
        os.environ.update(environment)
    return trainer


def write_lock(folder: Path, pid: int) -> Path:
    """A run-folder lock as a run of process `pid` on this host writes it."""
    from trainer.errors import process_start_time

    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / ".lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "proc_start": process_start_time(pid),
                                "started": "2024-01-02 03:04:05"}))
    return lock


def read_metrics(dump_folder: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(dump_folder) / "metrics.jsonl").read_text().splitlines()]


def cpu_float8_emulated(scaling: str) -> bool:
    """True where this torch cannot run the recipe's float8 GEMMs on CPU (rowwise before 2.13)."""
    from float8.gemm import scaled_mm_supported

    return not scaled_mm_supported(scaling != "tensorwise", "cpu")


def sqnr(ref, actual) -> float:
    """Signal to quantization-noise ratio of `actual` against `ref`, in dB (float64)."""
    ref, actual = ref.double(), actual.double()
    return (20 * (ref.norm() / (ref - actual).norm()).log10()).item()


def linear_step(module, x: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype | None = None):
    """One forward and backward of `module` on a fresh leaf copy of `x` (in `dtype` if given), `grad`
    as the output's gradient: (output, x's gradient, the module's weight gradient or None)."""
    x = x.detach().to(dtype or x.dtype).clone().requires_grad_()
    out = module(x)
    out.backward(grad.to(out.dtype))
    weight = getattr(module, "weight", None)
    return out.detach(), x.grad, None if weight is None else weight.grad
