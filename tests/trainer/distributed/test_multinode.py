"""More than one machine, on one: two torchrun agents (`--nnodes 2 --nproc_per_node 2`) rendezvous over c10d on
127.0.0.1 and train HSDP 2x2, the replicas across the two "nodes" and the shards within each, to the losses of one
4-process run; its checkpoint resumes on one node as FSDP 4, and the FSDP 4 run's as HSDP 2x2 (same global batch).
Two 4-step runs (checkpoints at steps 2 and 4) and one resumed leg each, from step 2. And the SLURM launcher's
torchrun command, with SLURM's commands stubbed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, free_port, read_metrics, run_train
from tests.layout_runs import BASE
from trainer.config import build_config


def _runs_marks(test):
    """Torchrun's rendezvous across agents, the same under every torch version: not `version_specific` (the 2.11
    job runs HSDP's parity in test_parallel.py and resumes across layouts in checkpoint/test_end_to_end.py)."""
    return pytest.mark.slow(pytest.mark.timeout(600)(test))

STEPS = ["--training.steps", "4", "--training.batch_size", "2", "--checkpoint.enable", "true",
         "--checkpoint.interval", "2"]
HSDP_2X2 = ["--parallelism.data_parallel_replicate_degree", "2"]


def _losses(folder: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(folder)}


def _train(folder: Path, layout: list[str], *extra: str) -> str:
    """A one-node run of 4 ranks."""
    result = run_train([*BASE, *STEPS, *layout, "--job.dump_folder", str(folder), *extra], nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _train_two_nodes(folder: Path) -> list[str]:
    """HSDP 2x2 as two torchrun agents of 2 ranks each, as on two machines: the output of each."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes",
           "train.py", *BASE, *STEPS, *HSDP_2X2, "--job.dump_folder", str(folder / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [folder / f"node{i}.log" for i in range(2)]
    agents = []
    for log in logs:
        with log.open("w") as out:
            agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        codes = [agent.wait(timeout=540) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(text[-3000:] for text in texts)
    return texts


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The dump folders of the two-node HSDP 2x2 run and of a one-node FSDP 4 run."""
    two_nodes = tmp_path_factory.mktemp("two_nodes")
    texts = _train_two_nodes(two_nodes)
    # Rank 0 (on one of the two) prints the summary: 4 ranks over the 3-D mesh.
    summaries = [line for text in texts for line in text.splitlines() if line.startswith("device ")]
    assert summaries == ["device cpu (no known peak (MFU off)) x 4; mesh dp=4 (replicate 2 x shard 2, HSDP) tp=1"]
    fsdp = tmp_path_factory.mktemp("fsdp")
    _train(fsdp, [])
    return {"HSDP 2x2": two_nodes / "run", "FSDP 4": fsdp}


@_runs_marks
def test_two_nodes_train_as_one(runs):
    # The same global batches; the gradients are summed in another order (within a pair, then across the
    # replicas), so the losses agree to rounding.
    two_nodes, one_node = _losses(runs["HSDP 2x2"]), _losses(runs["FSDP 4"])
    assert sorted(two_nodes) == [1, 2, 3, 4]
    assert two_nodes == pytest.approx(one_node, rel=1e-5)
    assert two_nodes[4] < two_nodes[1] - 0.5


@_runs_marks
@pytest.mark.parametrize(("saved", "resumed"), [("HSDP 2x2", "FSDP 4"), ("FSDP 4", "HSDP 2x2")])
def test_checkpoint_resumes_in_another_layout(runs, tmp_path, saved, resumed):
    # Same weights, same batches per data-parallel rank, the same 4-rank sum of the loss: the first step after
    # the resume is bitwise the saved run's; the next one's gradients were reduced in another order.
    shutil.copytree(runs[saved] / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(runs[saved] / "run_id", tmp_path / "run_id")
    out = _train(tmp_path, HSDP_2X2 if resumed == "HSDP 2x2" else [], "--checkpoint.load_step", "2")
    assert "resumed from checkpoint at step 2" in out
    before, after = _losses(runs[saved]), _losses(tmp_path)
    assert after[3] == before[3], f"{saved} -> {resumed}: step 3 {after[3]} vs {before[3]}"
    assert after[4] == pytest.approx(before[4], rel=1e-5)


def test_slurm_launcher_runs_one_agent_per_node(tmp_path):
    # scontrol names the nodes, srun records what it would run on each: one torchrun agent per node,
    # meeting on the first node, one HSDP replica per node, the options given to the script after.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-a\\ngpu-b\\n'\n")
    (stubs / "srun").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'srun.args'}\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT)}
    result = subprocess.run(["bash", "scripts/launch_slurm.sh", "--config", "configs/7b_fp8.toml"], cwd=ROOT, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "srun.args").read_text().split()
    assert build_config(args[args.index("train.py") + 1:]).parallelism.data_parallel_replicate_degree == 2
    assert args == [
        "--kill-on-bad-exit=1", "python", "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "8",
        "--rdzv-id", "7", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu-a:29500",
        "train.py", "--parallelism.data_parallel_replicate_degree", "2", "--config", "configs/7b_fp8.toml",
    ]
