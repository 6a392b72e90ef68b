"""Run train.py / scripts as a user would, in a subprocess, from the repo root."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(
    args: list[str], nproc: int = 1, timeout: int = 600, env: dict | None = None, script: str = "train.py"
) -> subprocess.CompletedProcess:
    """`script` (train.py, or a test wrapper of it) with `args`, under torchrun when nproc > 1."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    if nproc == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}", script, *args,
        ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)


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
