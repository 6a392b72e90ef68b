"""trainer/adamw_triton.py under the Triton interpreter on CPU tensors: torch's AdamW to fp32 rounding,
step after step, with its weight-decay groups; the fused kernel's guard protocol (`grad_scale` divides
the gradients, `found_inf` leaves weights, moments and step counts as they were) and the weights'
amaxes it hands the float8 all-gather, also on weights
that FSDP all-gathers in float8 (a wrapper subclass); and the state dict of torch's fused AdamW,
which each loads from the other."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the kernel in Triton's interpreter (tests/conftest.py sets it without a GPU)", allow_module_level=True)

pytestmark = pytest.mark.version_specific

pytest.importorskip("triton")

from float8.fsdp import Float8TrainingWeight  # noqa: E402
from trainer.adamw_triton import TritonAdamW  # noqa: E402

SHAPES = [(300, 70), (5000,), (3,)]  # one tensor spans several programs, one ends mid-block
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def _step(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor], **guard) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()
    for name, value in guard.items():
        setattr(opt, name, value)
    opt.step()
    for name in guard:
        delattr(opt, name)


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-6)


class DataAndScale(torch.Tensor):
    """A weight wrapped with a 0-dim scale beside its data, as torchao's float8 weights are once the
    float8 all-gather precomputed their scale: two inner tensors, ops on the data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor) -> None:
        self._data, self._scale = data, scale

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return DataAndScale(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._data if isinstance(t, DataAndScale) else t

        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


WRAPPERS = {
    "plain": None,
    "Float8TrainingWeight": lambda p: Float8TrainingWeight(p),
    "data and scale": lambda p: DataAndScale(p, torch.tensor(3.0)),
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_triton_adamw_is_torchs_adamw_with_the_fused_guard(wrapper):
    ref, tri = _params(), _params()
    if WRAPPERS[wrapper] is not None:
        tri = [WRAPPERS[wrapper](p.detach()).requires_grad_() if p.ndim == 2 else p for p in tri]
    ref_opt = torch.optim.AdamW(_groups(ref), foreach=False, **HYPER)
    tri_opt = TritonAdamW(_groups(tri), **HYPER)
    for step in range(3):
        grads = _grads(step)
        # grad_scale 2 on the Triton side against halved gradients on torch's.
        _step(ref_opt, ref, [g / 2 for g in grads])
        _step(tri_opt, tri, grads, grad_scale=torch.tensor(2.0))
        _assert_close(ref, tri)
        _assert_close([ref_opt.state[p]["exp_avg_sq"] for p in ref], [tri_opt.state[p]["exp_avg_sq"] for p in tri])
    before = [p.detach().clone() for p in tri], {k: v.clone() for k, v in tri_opt.state[tri[0]].items()}
    _step(tri_opt, tri, _grads(3), found_inf=torch.tensor(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before[0], tri))
    # The weights' amaxes from the step's own pass, also where a skipped step left them unchanged.
    assert all(torch.equal(tri_opt.weight_amaxes()[p], p.detach().abs().max()) for p in tri)
    assert all(torch.equal(v, tri_opt.state[tri[0]][k]) for k, v in before[1].items())
    assert float(tri_opt.state[tri[0]]["step"]) == 3


def test_weights_read_as_stored_get_their_rows_and_columns_amaxes():
    # float8's weights read as stored want each row's and column's amax from the step (for their two casts):
    # the 2-D kernel, its edge tiles masked (300 rows: 3 strips of 128, 144 columns: a strip of 16 after 128);
    # one whose columns are not a multiple of 16 takes the flat kernel and its one amax.
    shapes = [(300, 144), (30, 7), (64,)]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone().requires_grad_() for p in start]
    tri = [(Float8TrainingWeight(p.clone(), as_stored=True) if p.ndim == 2 else p.clone()).requires_grad_() for p in start]
    ref_opt, tri_opt = torch.optim.AdamW(_groups(ref), foreach=False, **HYPER), TritonAdamW(_groups(tri), **HYPER)
    for step in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        _step(ref_opt, ref, [g / 2 for g in grads])
        # The last step skipped (found_inf): the amaxes are those of the weights it left as they were.
        _step(tri_opt, tri, grads, grad_scale=torch.tensor(2.0), found_inf=torch.tensor(float(step == 2)))
        if step < 2:
            _assert_close(ref, tri)
        amaxes = tri_opt.weight_amaxes()
        w = tri[0].detach().abs()
        assert torch.equal(amaxes[tri[0]], torch.cat([w.amax(1), w.amax(0)]))
        assert all(torch.equal(amaxes[p], p.detach().abs().max()) for p in tri[1:])


def test_a_guarded_step_reads_nothing_on_the_host():
    # A read of a device value on the host waits for the device: the trainer's step would drain the
    # GPU's queue there (it did: `_foreach_add_` with one tensor operand reads it, twice a step).
    params = _params()
    opt = TritonAdamW(_groups(params), **HYPER)
    _step(opt, params, _grads(0))  # the first step builds the program tables: sizes, read once
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(opt, params, _grads(1), grad_scale=torch.tensor(2.0), found_inf=torch.tensor(0.0))
    reads = {e.name for e in prof.events()} & {"aten::item", "aten::_local_scalar_dense"}
    assert not reads and float(opt.state[params[0]]["step"]) == 2


def test_state_dict_is_torchs_fused_adamw_both_ways():
    tri, fused = _params(), _params()
    tri_opt, fused_opt = TritonAdamW(_groups(tri), **HYPER), torch.optim.AdamW(_groups(fused), fused=True, **HYPER)
    _step(tri_opt, tri, _grads(0))
    _step(fused_opt, fused, _grads(0))
    # Swap the states and continue: each optimizer takes the other's checkpoint as its own.
    tri_state, fused_state = tri_opt.state_dict(), fused_opt.state_dict()
    tri_opt.load_state_dict(fused_state)
    fused_opt.load_state_dict(tri_state)
    for opt, params in ((tri_opt, tri), (fused_opt, fused)):
        _step(opt, params, _grads(1))
    _assert_close(tri, fused)
    assert {k: v.dtype for k, v in tri_opt.state[tri[0]].items()} == {k: v.dtype for k, v in fused_opt.state[fused[0]].items()}


_COMPILE_FOR_HOPPER = '''
import itertools

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from trainer.adamw_triton import BLOCK, TILE_COLS, TILE_ROWS, TILES_DOWN, adamw_kernel, adamw_rows_columns_kernel

scalars = ["lr", "beta1", "beta2", "log2_beta1", "log2_beta2", "eps", "weight_decay"]
for (has_scale, has_inf), (p, g) in itertools.product([(False, False), (True, True)], [(tl.float32, tl.float32), (tl.bfloat16, tl.bfloat16)]):
    signature = {"addr_ptr": "*i64", "block_param_ptr": "*i32", "first_block_ptr": "*i32", "numel_ptr": "*i64",
                 "grad_scale_ptr": "*fp32" if has_scale else "constexpr", "found_inf_ptr": "*fp32" if has_inf else "constexpr",
                 "amax_ptr": "*i32", "n_params": "i32", **{name: "fp32" for name in scalars},
                 **{name: "constexpr" for name in ("P_DTYPE", "G_DTYPE", "S_DTYPE", "HAS_SCALE", "HAS_INF", "BLOCK")}}
    constexprs = {"P_DTYPE": p, "G_DTYPE": g, "S_DTYPE": p, "HAS_SCALE": has_scale, "HAS_INF": has_inf, "BLOCK": BLOCK,
                  **({} if has_scale else {"grad_scale_ptr": None}), **({} if has_inf else {"found_inf_ptr": None})}
    triton.compile(triton.compiler.ASTSource(fn=adamw_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32))
    del signature["numel_ptr"], signature["BLOCK"], constexprs["BLOCK"]
    signature = {"addr_ptr": "*i64", "block_param_ptr": "*i32", "first_block_ptr": "*i32", "shape_ptr": "*i64",
                 "amax_at_ptr": "*i64", **{k: v for k, v in signature.items() if k not in ("addr_ptr", "block_param_ptr",
                                                                                            "first_block_ptr")},
                 "TR": "constexpr", "TC": "constexpr", "TILES_DOWN": "constexpr"}
    constexprs.update(TR=TILE_ROWS, TC=TILE_COLS, TILES_DOWN=TILES_DOWN)
    triton.compile(triton.compiler.ASTSource(fn=adamw_rows_columns_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", 90, 32))
print("compiled")
'''


def test_kernel_compiles_for_hopper():
    """The kernel compiles to sm_90 code with the GPU's own compiler passes (Triton ships ptxas; no GPU
    needed), with and without the guard's tensors, fp32 and bf16 weights: the interpreter checks none of
    what only the compiler does."""
    from tests.helpers import assert_compiles_for_hopper

    assert_compiles_for_hopper(_COMPILE_FOR_HOPPER)
