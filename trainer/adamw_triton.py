"""AdamW as one Triton kernel per parameter (`optimizer.implementation = "triton"`).

Torch's fused AdamW updates every parameter in launches of a fixed number of blocks, whatever
the tensors' sizes; here each parameter gets a grid of its own size. Same update, same state
(`step` a device tensor, `exp_avg`, `exp_avg_sq`), same checkpoint format and the same protocol
as the fused kernel for the trainer's clip and non-finite guard (trainer/step.py): `grad_scale`
divides the gradients, a non-zero `found_inf` leaves weights, moments and step counts unchanged,
both read on the device, so nothing waits on the host. Results match torch's AdamW to fp32
rounding (the bias corrections are computed in the kernel as exp2(step log2(beta))).

Imported only where Triton is (torch's CUDA builds bring it); runs on CUDA tensors, and on CPU
tensors under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

BLOCK = 4096


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, grad_scale_ptr, found_inf_ptr, amax_ptr, n, lr, beta1, beta2, log2_beta1,
    log2_beta2, eps, weight_decay, HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, BLOCK: tl.constexpr,
):
    """Also the amax of the weight as the step leaves it, as int32 bits (order-preserving for |x|,
    NaN above inf) max-ed into amax_ptr."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    update = mask
    if HAS_INF:  # a non-finite step: no store (found_inf read per lane, one address); the amax still is the weight's
        update = mask & (tl.load(found_inf_ptr + offs * 0) == 0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(grad_scale_ptr)
    p_old = tl.load(p_ptr + offs, mask=mask, other=0.0)
    p = p_old.to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    step = tl.load(step_ptr)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    # torch's order: p + (-lr / bias1) * (m / denom)
    p = p - (lr / bias1) * (m / (tl.sqrt(v) / bias2_sqrt + eps))
    p = tl.where(update, p.to(p_ptr.dtype.element_ty), p_old)
    tl.store(p_ptr + offs, p, mask=update)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=update)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=update)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(p.to(tl.float32)).to(tl.int32, bitcast=True), axis=0))


def _memory(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose memory holds `t`: a DTensor's local shard, a wrapper subclass's single
    inner tensor (float8's Float8TrainingWeight, whose ops all run on it), recursively."""
    if isinstance(t, DTensor):
        return _memory(t._local_tensor)
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        if len(names) != 1:
            raise ValueError(f"TritonAdamW updates plain tensors or wrappers of one, got {type(t).__name__} of {names}")
        return _memory(getattr(t, names[0]))
    return t


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay, no amsgrad) stepped by `_adamw_kernel`.

    Constructed as torch's fused AdamW, so its state dict is that optimizer's, loadable by either;
    `grad_scale` and `found_inf` are taken from the optimizer's attributes as the fused one takes them.
    `weight_amaxes()`: each parameter's amax after the last step, from the step's own pass.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.01) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        self._amaxes: dict[torch.Tensor, torch.Tensor] = {}

    def weight_amaxes(self) -> dict[torch.Tensor, torch.Tensor]:
        """Parameter -> its max |value| after the last step (0-dim fp32; 0 for an empty shard)."""
        return self._amaxes

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("TritonAdamW.step takes no closure")
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        self._amaxes = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            steps = [self.state[p]["step"] for p in params]
            if not steps:
                continue
            # A skipped step (found_inf) counts nothing, as in torch's fused kernel.
            torch._foreach_add_(steps, 1.0 if found_inf is None else 1.0 - found_inf)
            amax_bits = torch.zeros(len(params), dtype=torch.int32, device=steps[0].device)
            self._amaxes.update(zip(params, amax_bits.view(torch.float32).unbind()))
            for p, step, amax in zip(params, steps, amax_bits.unbind()):
                state = self.state[p]
                tensors = [_memory(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
                if not all(t.is_contiguous() for t in tensors):
                    raise ValueError(f"TritonAdamW needs contiguous parameters, gradients and moments, got {p.shape}")
                n = tensors[0].numel()
                if not n:
                    continue
                _adamw_kernel[(triton.cdiv(n, BLOCK),)](
                    *tensors, step, grad_scale, found_inf, amax, n, group["lr"], beta1, beta2, math.log2(beta1),
                    math.log2(beta2), group["eps"], group["weight_decay"], HAS_SCALE=grad_scale is not None,
                    HAS_INF=found_inf is not None, BLOCK=BLOCK, num_warps=8,
                )
