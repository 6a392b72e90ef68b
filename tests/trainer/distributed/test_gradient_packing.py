"""parallelism.gradient_packing: the copies write chunk_cat's bytes for every shape, dtype and rank count, FSDP2
packs with them, training is bitwise the same either way, and untested torch versions keep FSDP2's own."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import read_metrics, train_in_process
from trainer.config import build_config
from trainer.distributed import gradient_packing
from trainer.distributed.gradient_packing import (
    choose_gradient_packing,
    chunk_numel,
    pack_gradients,
)

pytestmark = pytest.mark.version_specific

# Dim 0 below, equal to, above and not a multiple of the rank counts; 1-D, 2-D and 3-D gradients.
SHAPES = [(5, 3), (8, 2), (3,), (1, 4), (7, 2, 3), (64,), (33, 5), (2, 1)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize(("grad_dtype", "reduce_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                                          (torch.bfloat16, torch.bfloat16)])
def test_the_same_bytes_as_chunk_cat(world_size, grad_dtype, reduce_dtype):
    gen = torch.Generator().manual_seed(world_size)
    grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in SHAPES]
    numel = world_size * sum(chunk_numel(s, world_size) for s in SHAPES)
    expected = torch.full((world_size, numel // world_size), float("nan"), dtype=reduce_dtype)
    torch._chunk_cat(grads, 0, world_size, out=expected)
    packed = torch.full((numel,), float("nan"), dtype=reduce_dtype)  # padding left unwritten would stay NaN
    pack_gradients(grads, packed, world_size)
    assert torch.equal(packed.view(world_size, -1).view(torch.int16 if reduce_dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if reduce_dtype == torch.bfloat16 else torch.int32))


def _mirror_run(dump, packing: str) -> list[tuple[float, float]]:
    cfg = build_config([
        "--config", "configs/debug.toml", "--job.dump_folder", str(dump), "--training.steps", "2",
        "--training.batch_size", "2", "--training.seq_len", "32", "--training.device", "cpu", "--model.n_layers", "2",
        "--validation.enable", "false", "--data.num_workers", "0", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--parallelism.simulate_world_size", "4",
        "--parallelism.gradient_packing", packing,
    ])
    train_in_process(cfg)
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(dump)]


def test_fsdp_packs_with_the_copies_and_trains_bitwise_as_with_chunk_cat(tmp_path, monkeypatch):
    if choose_gradient_packing("copies")[0] != "copies":
        pytest.skip("the copies are not applied on this torch")
    packed_for: list[int] = []

    def recording(grads: list[torch.Tensor], buffer: torch.Tensor, world_size: int) -> None:
        packed_for.append(world_size)
        pack_gradients(grads, buffer, world_size)

    monkeypatch.setattr(gradient_packing, "pack_gradients", recording)
    copies = _mirror_run(tmp_path / "copies", "copies")
    assert packed_for and set(packed_for) == {4}  # FSDP's 4-rank reductions, each packed by the copies
    calls = len(packed_for)
    assert _mirror_run(tmp_path / "chunk_cat", "chunk_cat") == copies
    assert len(packed_for) == calls  # FSDP's own packing again


@pytest.mark.parametrize(
    ("choice", "version", "used", "noted"),
    [("copies", "2.13.0+cpu", "copies", False), ("copies", "2.11.0+cu130", "copies", False),
     ("copies", "2.12.1", "chunk_cat", True), ("chunk_cat", "2.13.0", "chunk_cat", False),
     ("copies", "2.14.1+cu130", "copies", False), ("copies", "2.15.0a0+git1234", "chunk_cat", True),
     ("chunk_cat", "2.14.0", "chunk_cat", False)],
)
def test_the_torch_version_gate(choice, version, used, noted):
    packing, text = choose_gradient_packing(choice, version)
    assert packing == used and (text is not None) == noted
    if noted:
        assert text == f"gradients packed by FSDP2's chunk_cat (the copies were tested on torch 2.11, 2.13 and 2.14, not {version})"


def test_the_startup_summary_says_when_the_copies_are_not_applied():
    import dataclasses

    from trainer.plan import RunPlan

    plan = RunPlan.resolve(build_config(["--training.device", "cpu"]), 1, load_tokenizer=False)
    assert plan.gradient_packing_text is None or plan.gradient_packing == "chunk_cat"
    packing, text = choose_gradient_packing("copies", "2.12.0")
    untested = dataclasses.replace(plan, gradient_packing=packing, gradient_packing_text=text)
    assert untested.fsdp_text() == "; ".join(t for t in (plan.fast_path.text, text) if t)
    assert text in untested.fsdp_text()
