"""FSDP2 at one rank with the shared reduce buffer (and the copies' packing): the same gradients as FSDP's own reduction, one buffer."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.helpers import free_port
from trainer.distributed.gradient_packing import use_gradient_packing
from trainer.distributed.single_rank_reduce import (
    SingleRankReduceScatter,
    use_single_rank_reduction,
)

pytestmark = pytest.mark.version_specific


class _Counting(SingleRankReduceScatter):
    calls = 0
    fresh = 0

    def allocate(self, size, *, dtype, device):
        out = super().allocate(size, dtype=dtype, device=device)
        _Counting.calls += 1
        _Counting.fresh += self._input is not None
        return out


def _model(shared: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 8))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))  # on the CPU where a GPU is present too
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    use_gradient_packing("copies" if shared else "chunk_cat")  # the trainer's pair: both, or FSDP's own
    if shared:
        use_single_rank_reduction(model)
        for module in model.modules():
            if hasattr(module, "set_custom_reduce_scatter"):
                module.set_custom_reduce_scatter(_Counting())
    return model


def _train(shared: bool) -> list[list[float]]:
    model = _model(shared)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    gen = torch.Generator().manual_seed(1)
    grads = []
    for _ in range(3):
        for i in range(2):  # gradient accumulation: the second reduction adds to the first
            model.set_requires_gradient_sync(i == 1)
            x = torch.randn(16, 32, generator=gen)
            model(x).float().square().mean().backward()
        grads.append([g for p in model.parameters() for g in p.grad.full_tensor().flatten().tolist()])
        opt.step()
        opt.zero_grad()
    grads.append([v for p in model.parameters() for v in p.full_tensor().flatten().tolist()])
    return grads


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    chunk_cats = [0]
    chunk_cat = torch._chunk_cat

    def counting_chunk_cat(*args, **kwargs):
        chunk_cats[0] += 1
        return chunk_cat(*args, **kwargs)

    torch._chunk_cat = counting_chunk_cat
    try:
        default = _train(False)
        default_chunk_cats = chunk_cats[0]
        result = {"default": default, "shared": _train(True), "calls": _Counting.calls, "fresh": _Counting.fresh,
                  "chunk_cats": [default_chunk_cats, chunk_cats[0] - default_chunk_cats]}
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_single_rank_reduce_matches_fsdp_and_allocates_one_buffer_per_reduction(tmp_path):
    out = tmp_path / "result.json"
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=1, join=True)
    result = json.loads(out.read_text())
    # Gradients of every step and the weights after the last one, bitwise.
    assert result["shared"] == result["default"]
    # 3 linears (each its own FSDP group; the root holds no parameters) x 3 steps, one
    # reduction each per step (the unsynced micro-batch accumulates unreduced). Each
    # reduction asks for an input and an output buffer, and only the input is a new one.
    assert result["calls"] == 2 * 9 and result["fresh"] == 9, result
    # FSDP packs each reduction's gradients with chunk_cat; the copies never do.
    assert result["chunk_cats"] == [9, 0]


def test_refuses_a_group_of_more_than_one():
    class Group:
        def size(self) -> int:
            return 2

    try:
        SingleRankReduceScatter()(torch.empty(1), torch.empty(2), Group(), None)
    except RuntimeError as e:
        assert "group of 2 ranks" in str(e)
    else:
        raise AssertionError("a reduce-scatter over 2 ranks was accepted")
