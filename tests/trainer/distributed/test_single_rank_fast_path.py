"""parallelism.single_rank_fast_path: training is bitwise the same with the one-rank patches and
without them, the switch decides whether they are applied, and untested torch versions get plain FSDP2."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import read_metrics, train_in_process
from trainer.distributed.single_rank_fast_path import TESTED_TORCH, choose_fast_path, torch_minor

pytestmark = pytest.mark.version_specific


def _train(dump, fast_path: bool) -> tuple[list[dict], list[bool]]:
    """The debug model (2 layers), float8 tensorwise with float8 all-gathers, 3 steps in this process (a gloo
    world of 1): the metrics, and for each FSDP group whether it has the one-rank unshard."""
    from trainer.config import build_config

    cfg = build_config([
        "--config", "configs/debug.toml", "--job.dump_folder", str(dump), "--training.steps", "3",
        "--training.batch_size", "2", "--training.seq_len", "32", "--training.device", "cpu", "--model.n_layers", "2",
        "--validation.enable", "false", "--data.num_workers", "0", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--float8.enabled", "true",
        "--float8.fsdp_float8_all_gather", "true", "--parallelism.single_rank_fast_path", str(fast_path).lower(),
    ])
    trainer = train_in_process(cfg)
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    patched = ["wait_for_unshard" in vars(g) for g in groups if g is not None]
    return read_metrics(dump), patched


@pytest.mark.slow
def test_training_is_bitwise_the_same_with_the_fast_path_on_and_off(tmp_path):
    if torch_minor(torch.__version__) not in TESTED_TORCH:
        pytest.skip("the fast path is not applied on this torch")
    on, on_patched = _train(tmp_path / "on", fast_path=True)
    off, off_patched = _train(tmp_path / "off", fast_path=False)
    assert on_patched and all(on_patched) and not any(off_patched)
    assert [r["step"] for r in on] == [1, 2, 3]
    assert [(r["loss"], r["grad_norm"]) for r in on] == [(r["loss"], r["grad_norm"]) for r in off]


@pytest.mark.parametrize(
    ("enabled", "dp", "version", "on", "text"),
    [
        (True, 1, "2.13.0+cpu", True, "single-rank fast path on"),
        (True, 1, "2.11.1+cu128", True, "single-rank fast path on"),
        (False, 1, "2.13.0", False, "single-rank fast path off (parallelism.single_rank_fast_path = false)"),
        (True, 1, "2.12.0", False,
         "single-rank fast path off: torch 2.12.0 is not one it was tested with (2.11, 2.13 and 2.14); plain FSDP2"),
        (True, 1, "2.15.0a0+git1234", False,
         "single-rank fast path off: torch 2.15.0a0+git1234 is not one it was tested with (2.11, 2.13 and 2.14); plain FSDP2"),
        (True, 1, "2.14.1+cu130", True, "single-rank fast path on"),
        (True, 8, "2.13.0", False, None),
    ],
)
def test_the_switch_and_the_torch_version_gate(enabled, dp, version, on, text):
    choice = choose_fast_path(enabled, dp, version)
    assert (choice.on, choice.text) == (on, text)
