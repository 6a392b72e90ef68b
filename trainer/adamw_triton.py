"""AdamW as one Triton launch per parameter group (`optimizer.implementation = "triton"`).

Torch's fused AdamW updates every parameter in launches of a fixed number of blocks, whatever
the tensors' sizes. Here one launch covers a group's parameters: program `pid` updates BLOCK
elements of parameter `block_param[pid]`, whose weight, gradient, moments and step count it
finds in a table of addresses written each step (5 x parameters, int64: the gradients' memory
moves between steps, the rest does not). The program-to-parameter tables depend on the sizes
alone and are built once. Same update, same state (`step` a device tensor, `exp_avg`,
`exp_avg_sq`), same checkpoint format and the same protocol as the fused kernel for the
trainer's clip and non-finite guard (trainer/step.py): `grad_scale` divides the gradients, a
non-zero `found_inf` leaves weights, moments and step counts unchanged, both read on the
device, so nothing waits on the host. Results match torch's AdamW to fp32 rounding (the bias
corrections are computed in the kernel as exp2(step log2(beta))). Each weight's amax comes from the
same pass; weights that ask for the amaxes of their rows and columns (float8's rowwise weights read
as stored at one rank) are updated by a second launch, `adamw_rows_columns_kernel`, in 2-D tiles.

Imported only where Triton is (torch's CUDA builds bring it); runs on CUDA tensors, and on CPU
tensors under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from trainer.host_copies import queued_to

# Elements and warps per program: within 1 % of the fastest of 1,024-8,192 x 4-16 on one H100, and the
# size least sensitive to its warp count (scripts/bench_float8_casts.py --only adamw, docs/benchmarks.md).
BLOCK = 2048
NUM_WARPS = 8
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Rows of the address table: weight, gradient, first moment, second moment, step count.
_ROLES = 5
# `adamw_rows_columns_kernel`'s programs: TILES_DOWN tiles of TILE_ROWS x TILE_COLS, each of BLOCK elements.
TILE_ROWS, TILE_COLS, TILES_DOWN = 16, 128, 8


@triton.jit
def _update(
    p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, step, grad_scale_ptr, keep, lr, beta1, beta2, log2_beta1, log2_beta2, eps,
    weight_decay, HAS_SCALE: tl.constexpr, MASKED: tl.constexpr,
):
    """One block's update, stored; returns the |weight| bits as the step leaves it (int32, in the order of
    the values; 0 where masked). Unmasked for whole flat blocks: a mask of a length read from memory would
    keep the loads from vectorizing."""
    if MASKED:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p_old = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m_old = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v_old = tl.load(v_ptr + offs, mask=mask, other=0.0)
    else:
        g = tl.load(g_ptr + offs).to(tl.float32)
        p_old = tl.load(p_ptr + offs)
        m_old = tl.load(m_ptr + offs)
        v_old = tl.load(v_ptr + offs)
    if HAS_SCALE:
        g = g / tl.load(grad_scale_ptr)
    p, m, v = p_old.to(tl.float32), m_old.to(tl.float32), v_old.to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    # torch's order: p + (-lr / bias1) * (m / denom)
    p = p - (lr / bias1) * (m / (tl.sqrt(v) / bias2_sqrt + eps))
    # A skipped step writes back what it read: the same bits, and no branch around the stores.
    p = tl.where(keep, p_old, p.to(p_old.dtype))
    m = tl.where(keep, m_old, m.to(m_old.dtype))
    v = tl.where(keep, v_old, v.to(v_old.dtype))
    if MASKED:
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
    else:
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
    return tl.abs(p.to(tl.float32)).to(tl.int32, bitcast=True)


@triton.jit
def _parameter(addr_ptr, i, n_params, found_inf_ptr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
               S_DTYPE: tl.constexpr, HAS_INF: tl.constexpr):
    """Parameter i's weight, gradient and moment pointers from the address table (16-byte aligned: the
    caller checks), its step count, and whether the step is skipped (found_inf)."""
    p_ptr = tl.multiple_of(tl.load(addr_ptr + i).to(tl.pointer_type(P_DTYPE)), 16)
    g_ptr = tl.multiple_of(tl.load(addr_ptr + n_params + i).to(tl.pointer_type(G_DTYPE)), 16)
    m_ptr = tl.multiple_of(tl.load(addr_ptr + 2 * n_params + i).to(tl.pointer_type(S_DTYPE)), 16)
    v_ptr = tl.multiple_of(tl.load(addr_ptr + 3 * n_params + i).to(tl.pointer_type(S_DTYPE)), 16)
    step = tl.load(tl.load(addr_ptr + 4 * n_params + i).to(tl.pointer_type(tl.float32)))
    keep = False
    if HAS_INF:
        keep = tl.load(found_inf_ptr) != 0
    return p_ptr, g_ptr, m_ptr, v_ptr, step, keep


@triton.jit
def adamw_kernel(
    addr_ptr, block_param_ptr, first_block_ptr, numel_ptr, grad_scale_ptr, found_inf_ptr, amax_ptr, n_params, lr, beta1,
    beta2, log2_beta1, log2_beta2, eps, weight_decay, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr,
):
    """Also each weight's amax as the step leaves it, as int32 bits (order-preserving for |x|, NaN
    above inf) max-ed into amax_ptr[parameter]. Every address is 16-byte aligned (the caller checks)."""
    pid = tl.program_id(0)
    i = tl.load(block_param_ptr + pid)
    start = (pid - tl.load(first_block_ptr + i)).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    n = tl.load(numel_ptr + i)
    p_ptr, g_ptr, m_ptr, v_ptr, step, keep = _parameter(addr_ptr, i, n_params, found_inf_ptr, P_DTYPE, G_DTYPE, S_DTYPE,
                                                        HAS_INF)
    if start + BLOCK <= n:
        bits = _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, None, step, grad_scale_ptr, keep, lr, beta1, beta2, log2_beta1,
                       log2_beta2, eps, weight_decay, HAS_SCALE, False)
    else:
        bits = _update(p_ptr, g_ptr, m_ptr, v_ptr, offs, offs < n, step, grad_scale_ptr, keep, lr, beta1, beta2,
                       log2_beta1, log2_beta2, eps, weight_decay, HAS_SCALE, True)
    tl.atomic_max(amax_ptr + i, tl.max(bits, axis=0))


@triton.jit
def adamw_rows_columns_kernel(
    addr_ptr, block_param_ptr, first_block_ptr, shape_ptr, amax_at_ptr, grad_scale_ptr, found_inf_ptr, amax_ptr, n_params,
    lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr,
    S_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr,
    TILES_DOWN: tl.constexpr,
):
    """`adamw_kernel`'s update of 2-D (rows, cols) weights, cols a multiple of 16, with each row's and each
    column's amax as the step leaves them (int32 bits) max-ed into amax_ptr[at:at + rows] and
    amax_ptr[at + rows:at + rows + cols], at = amax_at[parameter]: program `pid` updates TILES_DOWN tiles of
    TR x TC down one strip of columns, so a column's partial max takes one atomic per TILES_DOWN tiles."""
    pid = tl.program_id(0)
    i = tl.load(block_param_ptr + pid)
    b = pid - tl.load(first_block_ptr + i)
    rows = tl.load(shape_ptr + 2 * i)
    cols = tl.multiple_of(tl.load(shape_ptr + 2 * i + 1), 16)
    strips = tl.cdiv(cols, TC)
    rk = (b % strips) * TC + tl.arange(0, TC)
    first_row = (b // strips) * (TR * TILES_DOWN)
    p_ptr, g_ptr, m_ptr, v_ptr, step, keep = _parameter(addr_ptr, i, n_params, found_inf_ptr, P_DTYPE, G_DTYPE, S_DTYPE,
                                                        HAS_INF)
    param_amax_ptr = amax_ptr + tl.load(amax_at_ptr + i)
    # Column maxes kept per lane across the tiles, reduced across warps once at the end.
    col_max = tl.zeros([TR, TC], dtype=tl.int32)
    if (first_row + TR * TILES_DOWN <= rows) & ((b % strips + 1) * TC <= cols):
        for t in range(TILES_DOWN):
            rm = first_row + t * TR + tl.arange(0, TR)
            bits = _update(p_ptr, g_ptr, m_ptr, v_ptr, rm.to(tl.int64)[:, None] * cols + rk[None, :], None, step,
                           grad_scale_ptr, keep, lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay, HAS_SCALE, False)
            tl.atomic_max(param_amax_ptr + rm, tl.max(bits, axis=1))
            col_max = tl.maximum(col_max, bits)
    else:
        for t in range(TILES_DOWN):
            rm = first_row + t * TR + tl.arange(0, TR)
            bits = _update(p_ptr, g_ptr, m_ptr, v_ptr, rm.to(tl.int64)[:, None] * cols + rk[None, :],
                           (rm[:, None] < rows) & (rk[None, :] < cols), step, grad_scale_ptr, keep, lr, beta1, beta2,
                           log2_beta1, log2_beta2, eps, weight_decay, HAS_SCALE, True)
            tl.atomic_max(param_amax_ptr + rm, tl.max(bits, axis=1), mask=rm < rows)
            col_max = tl.maximum(col_max, bits)
    tl.atomic_max(param_amax_ptr + rows + rk, tl.max(col_max, axis=0), mask=rk < cols)


def _memory(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose memory holds `t`: a DTensor's local shard, or a wrapper subclass's one
    inner tensor of the wrapper's shape and dtype (float8's Float8TrainingWeight; torchao's float8
    weights, which also carry a precomputed 0-dim scale once the float8 all-gather computed one),
    recursively."""
    if isinstance(t, DTensor):
        return _memory(t._local_tensor)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, n) for n in names]
        data = [x for x in inner if x.shape == t.shape and x.dtype == t.dtype]
        if len(data) != 1:
            raise ValueError(f"TritonAdamW updates plain tensors or wrappers of one tensor of their shape and dtype, "
                             f"got {type(t).__name__} of {names}")
        return _memory(data[0])
    return t


def block_tables(counts: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parameter of each program, first program of each parameter) for `counts` programs a parameter."""
    programs = torch.tensor(counts, dtype=torch.int64)
    first = torch.cumsum(programs, 0) - programs
    block_param = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), programs)
    return block_param.to(device), first.to(torch.int32).to(device)


def flat_programs(numel: int, block: int = BLOCK) -> int:
    return triton.cdiv(numel, block)


def rows_columns_programs(shape: tuple[int, int]) -> int:
    return triton.cdiv(shape[0], TILE_ROWS * TILES_DOWN) * triton.cdiv(shape[1], TILE_COLS)


def _wants_rows_and_columns(p: torch.Tensor, memory: torch.Tensor) -> bool:
    """Whether `p` asks for its rows' and columns' amaxes (`wants_row_and_column_amaxes`, float8's weights
    read as stored) and the 2-D kernel takes it: 2-D, columns a multiple of 16 (its loads' alignment)."""
    local = p._local_tensor if isinstance(p, DTensor) else p
    return getattr(local, "wants_row_and_column_amaxes", False) and memory.ndim == 2 and memory.shape[1] % 16 == 0


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay, no amsgrad) stepped by `adamw_kernel`.

    Constructed as torch's fused AdamW, so its state dict is that optimizer's, loadable by either;
    `grad_scale` and `found_inf` are taken from the optimizer's attributes as the fused one takes them.
    `weight_amaxes()`: each parameter's amax after the last step, from the step's own pass; of a 2-D one
    whose (local) tensor has `wants_row_and_column_amaxes` (float8's weights read as stored), its rows'
    and columns' amaxes instead (`adamw_rows_columns_kernel`).
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.01) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self._amaxes: dict[torch.Tensor, torch.Tensor] = {}
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}

    def weight_amaxes(self) -> dict[torch.Tensor, torch.Tensor]:
        """Parameter -> its max |value| after the last step (0-dim fp32; 0 for an empty shard), or that of each
        of its rows, then of each of its columns ((rows + columns,) fp32) where it wants those."""
        return self._amaxes

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW.step takes no closure")
        self._amaxes = {}
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if params:
                self._step_group(group, params)

    def _step_group(self, group: dict, params: list[torch.Tensor]) -> None:
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        steps = [self.state[p]["step"] for p in params]
        # A skipped step (found_inf) counts nothing, as in torch's fused kernel. A list of tensors, not
        # one: `_foreach_add_` reads a single tensor operand on the host, which waits for the device.
        torch._foreach_add_(steps, 1.0 if found_inf is None else [1.0 - found_inf] * len(steps))
        device = steps[0].device
        # One launch per kernel and combination of dtypes (the kernels' pointers are typed); empty shards need none.
        launches: dict[tuple, list[int]] = {}
        memories = []
        for i, p in enumerate(params):
            state = self.state[p]
            tensors = [_memory(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])]
            if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors):
                raise ValueError(f"TritonAdamW needs contiguous, 16-byte aligned parameters, gradients and moments, got {p.shape}")
            if tensors[2].dtype != tensors[3].dtype:
                raise ValueError(f"TritonAdamW needs both moments in one dtype, got {tensors[2].dtype} and {tensors[3].dtype}")
            memories.append(tensors)
            if tensors[0].numel():
                key = (_wants_rows_and_columns(p, tensors[0]), *(t.dtype for t in tensors[:3]))
                launches.setdefault(key, []).append(i)
        # An empty shard's amax: 0.
        self._amaxes.update((p, torch.zeros((), device=device)) for p, m in zip(params, memories) if not m[0].numel())
        for (rows_columns, *dtypes), members in launches.items():
            shapes = tuple(tuple(memories[i][0].shape) for i in members)
            addresses = [memories[i][role].data_ptr() for role in range(_ROLES) for i in members]
            # Queued behind the backward instead of waiting for it.
            table = queued_to(device, torch.tensor(addresses, dtype=torch.int64))
            block_param, first_block, sizes, amax_at = self._tables_for(rows_columns, shapes, device)
            args = (grad_scale, found_inf)
            hyper = (len(members), group["lr"], *group["betas"], *map(math.log2, group["betas"]), group["eps"],
                     group["weight_decay"])
            constants = {"P_DTYPE": _TRITON_DTYPES[dtypes[0]], "G_DTYPE": _TRITON_DTYPES[dtypes[1]],
                         "S_DTYPE": _TRITON_DTYPES[dtypes[2]], "HAS_SCALE": grad_scale is not None,
                         "HAS_INF": found_inf is not None, "num_warps": NUM_WARPS}
            # Each parameter's amax (rows', then columns' for the 2-D kernel), as int32 bits max-ed in.
            lengths = [sum(shape) for shape in shapes] if rows_columns else [1] * len(members)
            bits = torch.zeros(sum(lengths), dtype=torch.int32, device=device)
            if rows_columns:
                adamw_rows_columns_kernel[(block_param.numel(),)](
                    table, block_param, first_block, sizes, amax_at, *args, bits, *hyper, TR=TILE_ROWS, TC=TILE_COLS,
                    TILES_DOWN=TILES_DOWN, **constants)
            else:
                adamw_kernel[(block_param.numel(),)](table, block_param, first_block, sizes, *args, bits, *hyper,
                                                     BLOCK=BLOCK, **constants)
            amaxes = bits.view(torch.float32).split(lengths) if rows_columns else bits.view(torch.float32).unbind()
            self._amaxes.update(zip((params[i] for i in members), amaxes))

    def _tables_for(self, rows_columns: bool, shapes: tuple[tuple[int, ...], ...], device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(program -> parameter, parameter -> first program, numels or (rows, columns) pairs, and for the
        latter where each parameter's amaxes start): what the sizes fix, built once (a copy to the device
        each step would wait for it)."""
        key = (rows_columns, shapes, device)
        if key not in self._tables:
            amax_at = None
            if rows_columns:
                counts = tuple(rows_columns_programs(shape) for shape in shapes)
                sizes = torch.tensor([n for shape in shapes for n in shape], dtype=torch.int64)
                starts = [0, *itertools.accumulate(sum(shape) for shape in shapes)][:-1]
                amax_at = torch.tensor(starts, dtype=torch.int64).to(device)
            else:
                counts = tuple(flat_programs(math.prod(shape)) for shape in shapes)
                sizes = torch.tensor([math.prod(shape) for shape in shapes], dtype=torch.int64)
            self._tables[key] = (*block_tables(counts, device), sizes.to(device), amax_at)
        return self._tables[key]
