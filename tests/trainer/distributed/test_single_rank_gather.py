"""FSDP2 at one rank with the single-rank unshard: FSDP's own results bitwise, and kept float8
shards used in place (no copy, never freed by FSDP's reshard); rowwise weights read as stored
(fp32, no copy), their amaxes read at each unshard or once after the optimizer step, give the bf16
copy's results bitwise."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import trainer.distributed.single_rank_gather as single_rank_gather
from tests.helpers import free_port

pytestmark = pytest.mark.version_specific

STEPS = 4


def _groups(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return [g for g in groups if g is not None]


def _model(float8: bool | str, single: bool) -> nn.Module:
    """`float8`: False, True (tensorwise with the float8 all-gather) or "rowwise" (read as stored when `single`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from float8 import Float8Config, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128, bias=not float8), nn.GELU(), nn.Linear(128, 64, bias=False), nn.GELU(),
        nn.Linear(64, 32, bias=not float8),
    )
    if float8:
        config = Float8Config(scaling="rowwise", fsdp_unshard_as_stored=single) if float8 == "rowwise" \
            else Float8Config(fsdp_float8_all_gather=True)
        convert_to_float8_training(model, config=config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1,))  # on the CPU where a GPU is present too
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if single:
        single_rank_gather.use_single_rank_gather(model)
    return model


def _kept_shard(layer: nn.Module) -> torch.Tensor | None:
    """The kept float8 shard, or for a weight read as stored the shard itself."""
    local = layer._get_fsdp_state()._fsdp_param_group.fsdp_params[0].sharded_param._local_tensor  # the weight
    return local._tensor if getattr(local, "_as_stored", False) else getattr(local, "_float8_shard", None)


def _train(float8: bool | str, single: bool, cast_weights: list[bool], triton_adamw: bool = False) -> dict:
    from float8 import precompute_float8_scales_for_fsdp
    from float8.fsdp import plain_weight

    model = _model(float8, single)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    in_place: list[list[bool]] = []

    def record_aliasing(layer: nn.Module, _args) -> None:
        kept = _kept_shard(layer)
        in_place[-1].append(kept is not None and layer.weight._data.data_ptr() == kept.data_ptr())

    for layer in linears:
        layer.register_forward_pre_hook(record_aliasing)
    if triton_adamw:
        from trainer.adamw_triton import TritonAdamW

        opt = TritonAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amax_from_optimizer = []
    gen = torch.Generator().manual_seed(1)
    losses, grads, kept_ptrs = [], [], []
    x, target = torch.randn(16, 64, generator=gen), 0.1 * torch.randn(16, 32, generator=gen)
    for step in range(STEPS):
        in_place.append([])
        loss = ((model(x).float() - target) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append([g for p in model.parameters() for g in p.grad.full_tensor().flatten().tolist()])
        opt.step()
        opt.zero_grad()
        if float8 is True:
            precompute_float8_scales_for_fsdp(model, cast_weights=cast_weights[step])
            kept_ptrs.append([k.data_ptr() if (k := _kept_shard(m)) is not None else None for m in linears])
        elif float8 == "rowwise" and cast_weights[step]:
            # The weights' rows' and columns' amaxes for the step's casts (else read at each unshard): read
            # once here, or the Triton AdamW's, found as it wrote the weights.
            amaxes = opt.weight_amaxes() if triton_adamw else None
            precompute_float8_scales_for_fsdp(model, amaxes=amaxes)
            amax_from_optimizer.append([amaxes is not None and getattr(m.weight._local_tensor, "_amax", None) is amaxes[m.weight]
                                        for m in linears])
    weights = [v for p in model.parameters() for v in plain_weight(p).full_tensor().flatten().tolist()]
    return {"losses": losses, "grads": grads, "weights": weights, "in_place": in_place, "kept_ptrs": kept_ptrs,
            "amax_from_optimizer": amax_from_optimizer}


def _triton_interprets() -> bool:
    """Whether the Triton AdamW runs here: Triton (torch's CUDA builds) and its interpreter on the CPU."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    waits = [0]
    plain_wait = single_rank_gather._wait_for_unshard_single_rank

    def counting_wait(group) -> None:
        waits[0] += 1
        plain_wait(group)

    single_rank_gather._wait_for_unshard_single_rank = counting_wait
    try:
        result = {}
        for name, float8, cast in [
            ("bf16", False, [False] * STEPS),
            ("float8", True, [False] * STEPS),
            ("float8_cast_once", True, [True] * STEPS),
            # kept, then cast at each all-gather, then kept again: FSDP's storage and the kept shard in turn
            ("float8_switching", True, [True, False, True, True]),
            ("rowwise", "rowwise", [False] * STEPS),
            ("rowwise_amax_after_step", "rowwise", [True] * STEPS),
            ("rowwise_amax_from_the_optimizer", "rowwise", [True] * STEPS),
        ]:
            triton_adamw = name.endswith("optimizer")
            if triton_adamw and not _triton_interprets():
                continue
            before = waits[0]
            result[name] = {"fsdp": _train(float8, False, cast, triton_adamw), "single": _train(float8, True, cast, triton_adamw)}
            result[name]["waits"] = waits[0] - before
        Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_single_rank_gather_matches_fsdp_and_uses_kept_float8_shards_in_place(tmp_path):
    out = tmp_path / "result.json"
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=1, join=True)
    result = json.loads(out.read_text())
    for name, run in result.items():
        fsdp, single = run["fsdp"], run["single"]
        # Every step's loss and gradients and the final weights, bitwise.
        for key in ("losses", "grads", "weights"):
            assert single[key] == fsdp[key], (name, key)
        assert fsdp["losses"][-1] < fsdp["losses"][0], name
        # 3 layers, each unsharded in forward and again in backward, every step.
        assert run["waits"] == 3 * 2 * STEPS, name
        # FSDP's own path always copies into its own storage.
        assert not any(any(step) for step in fsdp["in_place"]), name
    # No kept shard: FSDP's storage, every step.
    assert result["float8"]["single"]["in_place"] == [[False] * 3] * STEPS
    # Step 1 casts at the all-gather (nothing kept yet); from step 2 on the weight *is* the kept
    # shard, rewritten in place by each step's cast: the same storage from then on.
    once = result["float8_cast_once"]["single"]
    assert once["in_place"] == [[False] * 3] + [[True] * 3] * (STEPS - 1)
    assert all(ptrs == once["kept_ptrs"][0] for ptrs in once["kept_ptrs"]) and None not in once["kept_ptrs"][0]
    switching = result["float8_switching"]["single"]
    assert switching["in_place"] == [[False] * 3, [True] * 3, [False] * 3, [True] * 3]
    # Rowwise weights read as stored: every unshard is the fp32 shard itself, from the first step on.
    assert result["rowwise"]["single"]["in_place"] == [[True] * 3] * STEPS
    # Their amaxes, where the Triton AdamW runs, are those it found as it wrote them.
    if "rowwise_amax_from_the_optimizer" in result:
        assert result["rowwise_amax_from_the_optimizer"]["single"]["amax_from_optimizer"] == [[True] * 3] * STEPS

