"""The blockwise recipe's FSDP2 float8 all-gather, 2 gloo processes on CPU: each shard casts its own
128x128 blocks with no amax all-reduce, a weight whose dim-0 shards would cut blocks is sharded on
dim 1, and the gathered float8 bytes and block scales are bitwise those of casting the full weight,
at the first all-gather (scales gathered there) and after the post-step precompute (one scale
all-gather per step, with and without the kept shards). The trainer's layouts (FSDP=2, TP=2,
FSDP x TP) against one process: tests/trainer/distributed/test_parallel.py and tests/trainer/distributed/test_parallel_2d.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.float8.test_distributed import _spawn

pytestmark = [pytest.mark.slow, pytest.mark.version_specific]


def _full(weight) -> torch.Tensor:
    """The whole high-precision weight from every rank's shard, by its FSDP placement."""
    shard = weight._local_tensor._tensor.contiguous()
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, shard)
    return torch.cat(parts, dim=weight.placements[0].dim)


def _fsdp_blocks(rank: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from float8 import Float8Config, convert_to_float8_training, precompute_float8_scales_for_fsdp
    from float8.blocks import cast_blockwise
    from float8.fsdp_blocks import fsdp_shard_placement
    from float8.scaling import E4M3

    torch.manual_seed(0)
    # 384 rows over 2 ranks are 192 each, cutting 128-row blocks: that weight is sharded on its columns.
    model = nn.Sequential(nn.Linear(256, 384, bias=False), nn.ReLU(), nn.Linear(384, 256, bias=False))
    convert_to_float8_training(model, config=Float8Config(scaling="blockwise", fsdp_float8_all_gather=True))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mp_policy=policy, shard_placement_fn=fsdp_shard_placement(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    linears = [model[0], model[2]]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in linears:
        layer.register_forward_pre_hook(lambda m, _: seen.append((m.weight._data.clone(), m.weight._scale.clone())))
    all_reduces, plain_all_reduce = [0], dist.all_reduce

    def counting(*args, **kwargs):
        all_reduces[0] += 1
        return plain_all_reduce(*args, **kwargs)

    same, losses = [], []
    x = torch.randn(64, 256)
    # Step 1's all-gathers gather their scales themselves; step 2's use the precompute's scales and
    # cast their shards; steps 3 and 4 hand on the kept float8 shards (step 4's rewritten in place).
    for cast_weights in (False, True, True, None):
        wants = [cast_blockwise(_full(layer.weight), (128, 128), E4M3) for layer in linears]
        seen.clear()
        dist.all_reduce = counting
        out = model(x)
        dist.all_reduce = plain_all_reduce
        same.append([torch.equal(d.view(torch.uint8), w[0].view(torch.uint8)) and torch.equal(s, w[1])
                     for (d, s), w in zip(seen, wants)])
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cast_weights is not None:
            precompute_float8_scales_for_fsdp(model, cast_weights=cast_weights)
        losses.append(loss.item())
    return {"same": same, "placements": [layer.weight.placements[0].dim for layer in linears],
            "forward_all_reduces": all_reduces[0], "losses": losses}


def test_fsdp_blockwise_gathers_the_full_weights_cast_bitwise(tmp_path):
    result = _spawn(_fsdp_blocks, tmp_path)
    assert result["placements"] == [1, 0]
    assert result["same"] == [[True, True]] * 4
    assert result["forward_all_reduces"] == 0
    assert result["losses"][-1] < result["losses"][0]
