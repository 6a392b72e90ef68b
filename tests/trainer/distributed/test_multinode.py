"""HSDP checkpoints across layouts: an HSDP 2x2 checkpoint resumes in FSDP 4 and an FSDP 4 one in HSDP 2x2,
at the same global batch, each continuing exactly where its run left off.

One run of each layout (4 ranks, 4 steps, checkpoints at steps 2 and 4) and one resumed leg each, from step 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers import read_metrics, run_train
from tests.layout_runs import BASE

pytestmark = [pytest.mark.slow, pytest.mark.version_specific, pytest.mark.timeout(600)]

STEPS = ["--training.steps", "4", "--training.batch_size", "2", "--checkpoint.enable", "true",
         "--checkpoint.interval", "2"]
LAYOUTS = {"HSDP 2x2": ["--parallelism.data_parallel_replicate_degree", "2"], "FSDP 4": []}


def _losses(folder: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in read_metrics(folder)}


def _train(folder: Path, layout: str, *extra: str) -> str:
    result = run_train([*BASE, *STEPS, *LAYOUTS[layout], "--job.dump_folder", str(folder), *extra], nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The dump folder of a 4-step run in each layout."""
    folders = {}
    for layout in LAYOUTS:
        folders[layout] = tmp_path_factory.mktemp("run")
        _train(folders[layout], layout)
    return folders


@pytest.mark.parametrize(("saved", "resumed"), [("HSDP 2x2", "FSDP 4"), ("FSDP 4", "HSDP 2x2")])
def test_checkpoint_resumes_in_another_layout(runs, tmp_path, saved, resumed):
    # Same weights, same batches per data-parallel rank, the same 4-rank sum of the loss: the first step after
    # the resume is bitwise the saved run's. Later steps reduce gradients in another order (HSDP: within a
    # pair, then across the replicas), so they agree closely, not bitwise.
    shutil.copytree(runs[saved] / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(runs[saved] / "run_id", tmp_path / "run_id")
    out = _train(tmp_path, resumed, "--checkpoint.load_step", "2")
    assert "resumed from checkpoint at step 2" in out
    before, after = _losses(runs[saved]), _losses(tmp_path)
    assert after[3] == before[3], f"{saved} -> {resumed}: step 3 {after[3]} vs {before[3]}"
    assert after[4] == pytest.approx(before[4], rel=1e-4)
    assert _losses(runs["HSDP 2x2"]) == pytest.approx(_losses(runs["FSDP 4"]), rel=1e-4)
