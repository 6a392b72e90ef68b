"""Float8 with FSDP2 and tensor parallelism: 2 gloo processes on CPU."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.helpers import free_port, sqnr

pytestmark = [pytest.mark.slow, pytest.mark.version_specific]

WORLD = 2


def _spawn(worker, tmp_path: Path, *args) -> dict:
    mp.spawn(_entry, args=(worker, free_port(), str(tmp_path), args), nprocs=WORLD, join=True)
    return json.loads((tmp_path / "result.json").read_text())


def _entry(rank: int, worker, port: int, out_dir: str, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = worker(rank, *args)
        if rank == 0:
            Path(out_dir, "result.json").write_text(json.dumps(result))
        # Without it, a rank that tears gloo down while its peer still has a send in
        # flight makes the peer abort (SIGABRT), failing the test at random.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Only after success: gloo's threads outlive destroy_process_group (torch 2.13) and can
    # abort the interpreter's own teardown (SIGABRT) of a worker that has finished.
    os._exit(0)


# ---------------------------------------------------------------- FSDP2


def _record_all_gathers(log: list, contents: list | None = None) -> dict:
    """Log (dtype, bytes) of every all-gather input FSDP issues (its name differs across versions),
    and into `contents` a digest of the bytes themselves. Returns the original functions."""
    originals = {}
    for name in ("all_gather_into_tensor", "all_gather_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue
        originals[name] = original

        def recording(output, input, *args, _original=original, **kwargs):
            log.append((str(input.dtype), input.numel() * input.element_size()))
            if contents is not None:
                contents.append(hashlib.sha1(input.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
            return _original(output, input, *args, **kwargs)

        setattr(dist, name, recording)
    return originals


def _count_all_reduces() -> list:
    """Patch dist.all_reduce to count its calls: returns [count, the original function]."""
    state = [0, dist.all_reduce]

    def counting(*args, **kwargs):
        state[0] += 1
        return state[1](*args, **kwargs)

    dist.all_reduce = counting
    return state


def _fsdp_train(all_gather: bool, steps: int = 4, cast_weights: bool = False, amaxes_given: bool = False) -> dict:
    """`amaxes_given`: the precompute gets every weight shard's amax (as an optimizer computing them in
    its step would hand them over), counting the amax passes it still makes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    import float8.fsdp
    from float8 import Float8Config, convert_to_float8_training, precompute_float8_scales_for_fsdp
    from float8.fsdp import Float8TrainingWeight
    from float8.gathered import Float8GatheredWeight

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False), nn.ReLU(),
        nn.Linear(64, 32, bias=False),
    )
    convert_to_float8_training(model, config=Float8Config(fsdp_float8_all_gather=all_gather))
    seen_weight_types = set()
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(lambda m, _: seen_weight_types.add(type(m.weight).__name__))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    log: list = []
    contents: list = []
    all_gathers = _record_all_gathers(log, contents)
    all_reduces = _count_all_reduces()
    casts = [0]
    plain_cast = float8.fsdp.cast_weight_with_scale

    def counting_cast(*args, **kwargs):
        casts[0] += 1
        return plain_cast(*args, **kwargs)

    float8.fsdp.cast_weight_with_scale = counting_cast
    losses, step_all_reduces, precompute_all_reduces, step_casts = [], [], [], []
    amax_passes, plain_norm = [0], torch._foreach_norm

    def counting_norm(*args, **kwargs):
        amax_passes[0] += 1
        return plain_norm(*args, **kwargs)

    torch._foreach_norm = counting_norm
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        x, target = torch.randn(16, 64, generator=gen), 0.1 * torch.randn(16, 32, generator=gen)
        before, casts_before = all_reduces[0], casts[0]
        loss = ((model(x).float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_all_reduces.append(all_reduces[0] - before)
        step_casts.append(casts[0] - casts_before)
        if all_gather:
            before = all_reduces[0]
            amaxes = {p: p._local_tensor._tensor.abs().max().float() for p in model.parameters()
                      if isinstance(p._local_tensor, Float8TrainingWeight)} if amaxes_given else None
            precompute_float8_scales_for_fsdp(model, cast_weights=cast_weights, amaxes=amaxes)
            precompute_all_reduces.append(all_reduces[0] - before)
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    dist.all_reduce = all_reduces[1]
    torch._foreach_norm = plain_norm
    float8.fsdp.cast_weight_with_scale = plain_cast
    for name, original in all_gathers.items():
        setattr(dist, name, original)

    sharded = get_model_state_dict(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = all(isinstance(v, DTensor) and type(v._local_tensor) is torch.Tensor for v in sharded.values())
    plain = plain and all(type(v) is torch.Tensor for v in full.values())
    return {
        "losses": losses,
        "step_all_reduces": step_all_reduces,
        "precompute_all_reduces": precompute_all_reduces,
        "all_gathers": sorted(set(log)),
        "all_gather_contents": contents,
        "step_casts": step_casts,
        "amax_passes": amax_passes[0],
        "weight_types": sorted(seen_weight_types),
        "plain_state_dict": plain,
        "gathered_is_float8": Float8GatheredWeight.__name__ in seen_weight_types,
    }


def _fsdp_worker(rank: int) -> dict:
    return {"on": _fsdp_train(True), "off": _fsdp_train(False), "cast_once": _fsdp_train(True, cast_weights=True),
            "amaxes_given": _fsdp_train(True, amaxes_given=True)}


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict:
    return _spawn(_fsdp_worker, tmp_path_factory.mktemp("fsdp"))


def test_fsdp_float8_all_gather(fsdp_runs):
    on, off = fsdp_runs["on"], fsdp_runs["off"]
    # Same weights: only the float8 rounding of fp32 vs bf16-rounded weights differs.
    assert on["losses"][0] == pytest.approx(off["losses"][0], rel=5e-3)
    assert on["losses"] == pytest.approx(off["losses"], rel=3e-2)
    assert on["losses"][-1] < on["losses"][0]
    # Each layer's shard goes on the wire at 1 byte per parameter (as uint8), not bf16's 2.
    shard_numels = {64 * 128 // WORLD, 64 * 32 // WORLD}
    assert set(map(tuple, on["all_gathers"])) == {("torch.uint8", n) for n in shard_numels}
    assert set(map(tuple, off["all_gathers"])) == {("torch.bfloat16", 2 * n) for n in shard_numels}
    # Step 1 has no precomputed scales: one amax all-reduce per all-gather (3 layers, in
    # forward and again in backward). Afterwards the all-gathers use the scales that one
    # all-reduce after each step made.
    assert on["step_all_reduces"] == [6, 0, 0, 0]
    assert on["precompute_all_reduces"] == [1, 1, 1, 1]
    assert off["step_all_reduces"] == [0, 0, 0, 0]
    assert on["weight_types"] == ["Float8GatheredWeight"]
    assert on["plain_state_dict"] and off["plain_state_dict"]


def test_fsdp_float8_weights_cast_once_per_step(fsdp_runs):
    per_gather, once = fsdp_runs["on"], fsdp_runs["cast_once"]
    # The same bytes on the wire at every all-gather of every step, so the same training.
    assert once["all_gather_contents"] == per_gather["all_gather_contents"]
    assert len(once["all_gather_contents"]) == 4 * 6
    assert once["losses"] == per_gather["losses"]
    # 3 layers gathered in forward and again in backward: 6 casts a step at the all-gathers;
    # cast once, only step 1's (nothing precast yet), then none: precompute casts each weight once.
    assert per_gather["step_casts"] == [6, 6, 6, 6]
    assert once["step_casts"] == [6, 0, 0, 0]
    assert once["step_all_reduces"] == per_gather["step_all_reduces"]


def test_fsdp_precompute_takes_the_amaxes_it_is_given(fsdp_runs):
    computed, given = fsdp_runs["on"], fsdp_runs["amaxes_given"]
    # The same scales, so the same bytes on the wire and the same training, with no amax pass of its own.
    assert given["all_gather_contents"] == computed["all_gather_contents"] and given["losses"] == computed["losses"]
    assert computed["amax_passes"] == 4 and given["amax_passes"] == 0


# ---------------------------------------------------------------- tensor parallel


class FeedForward(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x, unused=None):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.feed_forward = FeedForward()

    def forward(self, x):
        return x + self.feed_forward(x, None)


def _tp_worker(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from float8 import convert_to_float8_training
    from float8.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

    class RecordCollectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.log: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] != "wait_tensor":
                self.log.add((func.__name__.split(".")[0], str(args[0].dtype)))
            return func(*args, **(kwargs or {}))

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    hp = Net()
    ref = copy.deepcopy(hp)
    convert_to_float8_training(ref)
    tp = copy.deepcopy(ref)
    parallelize_module(tp, mesh, {
        "feed_forward": PrepareFloat8ModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        "feed_forward.w1": Float8ColwiseParallel(),
        "feed_forward.w3": Float8ColwiseParallel(),
        "feed_forward.w2": Float8RowwiseParallel(output_layouts=Shard(1)),
    })

    x = torch.randn(2, 32, 64)
    grad = torch.randn(2, 32, 64)
    x_ref, x_hp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref = ref(x_ref)
    out_ref.backward(grad)
    hp(x_hp).backward(grad)

    chunk = slice(rank * 16, (rank + 1) * 16)
    x_tp = x[:, chunk].clone().requires_grad_()
    with RecordCollectives() as rec:
        out_tp = tp(x_tp)
        out_tp.backward(grad[:, chunk])
    # Per tensor: (SQNR of TP float8 vs single-process float8, of single-process float8 vs
    # high precision, of TP float8 vs high precision). Local scales differ from global ones,
    # so TP and single-process float8 differ by float8 noise, not more.
    result = {
        "out": [sqnr(out_ref[:, chunk], out_tp), 0, 0],
        "grad_x": [sqnr(x_ref.grad[:, chunk], x_tp.grad), sqnr(x_hp.grad, x_ref.grad),
                   sqnr(x_hp.grad[:, chunk], x_tp.grad)],
        "collectives": sorted(rec.log),
    }
    for name in ("w1", "w2", "w3"):
        hp_g, ref_g = getattr(hp.feed_forward, name).weight.grad, getattr(ref.feed_forward, name).weight.grad
        tp_g = getattr(tp.feed_forward, name).weight.grad.full_tensor()
        result[f"grad_{name}"] = [sqnr(ref_g, tp_g), sqnr(hp_g, ref_g), sqnr(hp_g, tp_g)]
    return result


def test_tensor_parallel_float8_styles(tmp_path):
    result = _spawn(_tp_worker, tmp_path)
    assert result["out"][0] >= 25
    for key in ("grad_x", "grad_w1", "grad_w2", "grad_w3"):
        tp_vs_f8, f8_vs_hp, tp_vs_hp = result[key]
        assert tp_vs_f8 >= 20 and tp_vs_hp >= 20, (key, result[key])
        assert tp_vs_hp >= f8_vs_hp - 3, (key, result[key])
    collectives = {tuple(c) for c in result["collectives"] if c[0] != "_wrap_tensor_autograd"}
    # Activation and gradient all-gathers move float8 bytes only (no high-precision one
    # besides), reduce-scatters stay fp32, and the shared scales cost one fp32 amax all-reduce.
    assert collectives == {
        ("all_gather_into_tensor", "torch.uint8"),
        ("reduce_scatter_tensor", "torch.float32"),
        ("all_reduce", "torch.float32"),
    }
