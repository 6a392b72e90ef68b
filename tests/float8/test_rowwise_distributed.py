"""The rowwise recipe's FSDP2 float8 all-gather, 2 gloo processes on CPU: each shard casts itself per
row and per column (one all-reduce of the column amaxes), and the gathered float8 bytes and scales of
both casts are bitwise those of casting the full weight, at the first all-gather (scales exchanged
there) and after the post-step precompute (with and without the kept shards); training matches the
bf16 all-gather's. Unequal shards are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.float8.test_blockwise_distributed import _full
from tests.float8.test_distributed import _spawn

pytestmark = [pytest.mark.slow, pytest.mark.version_specific]


def _train(all_gather: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from float8 import Float8Config, convert_to_float8_training, precompute_float8_scales_for_fsdp
    from float8.scaling import E4M3, cast_colwise_t, cast_rowwise
    from tests.helpers import cpu_float8_emulated

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.ReLU(), nn.Linear(96, 64, bias=False))
    config = Float8Config(scaling="rowwise", fsdp_float8_all_gather=all_gather, emulate=cpu_float8_emulated("rowwise"))
    convert_to_float8_training(model, config=config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model):
        fully_shard(layer, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    linears = [model[0], model[2]]
    seen: list[list[torch.Tensor]] = []
    if all_gather:
        for layer in linears:
            layer.register_forward_pre_hook(
                lambda m, _: seen.append([t.clone() for t in (m.weight._data, m.weight._scale, m.weight._cols, m.weight._cols_scale)]))
    all_reduces, plain_all_reduce = [0], dist.all_reduce

    def counting(*args, **kwargs):
        all_reduces[0] += 1
        return plain_all_reduce(*args, **kwargs)

    same, losses = [], []
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    # Step 1's all-gathers exchange their amaxes themselves; step 2's use the precompute's scales and
    # cast their shards; steps 3 and 4 hand on the kept buffers (step 4's rewritten in place).
    for cast_weights in (False, True, True, None):
        wants = [(*cast_rowwise(w, -1, E4M3, True, fused=False), *cast_colwise_t(w, E4M3, True, fused=False))
                 for w in (_full(layer.weight) for layer in linears)] if all_gather else []
        seen.clear()
        dist.all_reduce = counting
        out = model(x)
        dist.all_reduce = plain_all_reduce
        same.append([all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == E4M3 else torch.equal(a, b)
                         for a, b in zip(got, want)) for got, want in zip(seen, wants)])
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cast_weights is not None and all_gather:
            precompute_float8_scales_for_fsdp(model, cast_weights=cast_weights)
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return {"same": same, "forward_all_reduces": all_reduces[0], "losses": losses}


def _worker(rank: int) -> dict:
    return {"on": _train(True), "off": _train(False)}


def test_fsdp_rowwise_gathers_the_full_weights_casts_bitwise(tmp_path):
    result = _spawn(_worker, tmp_path)
    on, off = result["on"], result["off"]
    assert on["same"] == [[True, True]] * 4
    # Only step 1's forward all-gathers reduce the column amaxes, one per weight.
    assert on["forward_all_reduces"] == 2
    # The same weights: only the float8 rounding of fp32 against bf16-rounded weights differs.
    assert on["losses"] == pytest.approx(off["losses"], rel=2e-2)
    assert on["losses"][-1] < on["losses"][0]


def test_unequal_row_shards_are_refused_in_one_line():
    from float8.fsdp import Float8TrainingWeight
    from float8.recipe import RECIPES

    weight = Float8TrainingWeight(torch.zeros(10, 16), cast=RECIPES["rowwise"].output.rhs)
    assert weight.fsdp_shard_dim(2) == 0
    with pytest.raises(ValueError, match=r"^float8 rowwise FSDP all-gather: 10 rows over 4 ranks are not equal shards;[^\n]*$"):
        weight.fsdp_shard_dim(4)
