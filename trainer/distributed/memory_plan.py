"""A deliberately simple estimate of the peak memory per GPU, and the refusal of plans that cannot fit.

Per GPU, with P parameters, data-parallel degree dp (the FSDP shard degree: HSDP's replicas each hold
their shard group's whole state), tensor-parallel degree tp and
T = batch x seq / tp tokens per micro-batch (TP's sequence-parallel parts hold 1/tp of them):

    state       = P x (4 fp32 master + 8 AdamW) / (dp x tp)  + one block's gathered weights
                  (1 byte/param with float8, else the param dtype's bytes)
                + L x block params x 1 / (dp x tp)              (float8 all-gather with
                                                                 float8.cast_weights_once: the kept
                                                                 float8 shards)
    activations = L x T x dim x C[AC mode]                      (C below; AC full: block inputs
                                                                 only, plus one block's full set)
                + L x block params x 1 / tp                     (rowwise float8 on the one-GPU fast
                                                                 path: each weight's transposed float8
                                                                 bytes, kept from its forward to its
                                                                 backward; AC full: one block's)
                + T x vocab x (2 + 4 + 4)                       (bf16 logits, their fp32 upcast and
                                                                 the fp32 log-softmax of the eager
                                                                 loss; 2 alone with the loss compiled;
                                                                 B x S tokens of them under TP with
                                                                 parallelism.loss_parallel off)
                + B x S x S bytes                               (data.pack with SDPA: the dense bool
                                                                 document mask; flex's block mask holds
                                                                 4 x B x (S/128)^2 int32 tile indices)
                + B x heads/tp x S x S x 4                      (CPU only: one layer's score matrix;
                                                                 CUDA's flash/efficient SDPA is O(S))
    grads       = P x 4 / (dp x tp)
    peak        = state + max(activations, grads)

Grads do not add to activations: the trainer frees them after each step
(``zero_grad(set_to_none=True)``), so the peak is at the end of forward, where activations and
logits are all alive and no grad exists yet; in backward each grad takes the place of
activations that were just freed. Activation bytes scale with the param dtype (C is for bf16;
float32 params double it). Nothing here allocates: it runs before the model is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from models.llama.args import LlamaArgs
from models.llama.attention import FLEX_BLOCK_SIZE
from trainer.config import Config
from trainer.errors import UserError
from trainer.launch import local_world_size

GIB = 1024**3

# A plan is refused when its estimate exceeds this share of the device's memory: the estimate
# leaves out the CUDA context, the allocator's fragmentation, NCCL buffers and compile workspaces.
USABLE_FRACTION = 0.95

# Activation bytes per token x dim per layer with bf16 params (float8 linears save their
# float8 inputs: fewer bytes). Calibrated on one H200, torch 2.11, LLaMA-2-7B dims (dim 4096,
# 4 layers, 1.07B params with embedding and output), batch 8 x seq 4096, per-block compile,
# peak active memory (GiB):
#                  AC none   full    selective
#   float8 tensorwise  36.81   25.96   36.35
#   bf16               41.22   26.14   36.53
# Subtracted from each: the model's own state at the forward peak, weights + AdamW of
# 1.0717B params x 12 B = 11.98 GiB (grads are freed then; with them, 16 B/param = 15.97 GiB,
# the full-AC runs would leave nothing for activations), one gathered block (202.4M params:
# 0.19 GiB float8, 0.38 GiB bf16), and the logits 32768 tokens x 32000 x 10 B = 9.77 GiB.
# Left over per layer, over 32768 x 4096 token x dim elements:
#   none: float8 14.88 GiB / 4 -> 29.8 B, bf16 19.10 GiB / 4 -> 38.2 B
#   selective: float8 14.41 GiB / 4 -> 28.8 B, bf16 14.41 GiB / 4 -> 28.8 B
#   full: 4.0 GiB left for both (C 8.1 B), against what is modelled: block inputs (2 B x 4
#   layers = 1.0 GiB) plus one block's full set (none's C: 3.7 / 4.8 GiB); the estimates are
#   26.6 and 27.9 GiB, +3% (float8) and +7% (bf16) over the measures.
ACTIVATION_BYTES = {
    # (AC mode, float8): bytes per token x dim per layer
    ("none", True): 29.8,
    ("none", False): 38.2,
    ("selective", True): 28.8,
    ("selective", False): 28.8,
}
# AC full keeps each block's input (one bf16 tensor) and recomputes the rest one block at a time.
FULL_AC_BLOCK_INPUT_BYTES = 2.0
# Per logit (trainer/loss.py): the bf16 logits, and with the eager loss their fp32 upcast and the fp32
# log-softmax cross_entropy saves; the compiled loss keeps nothing of the vocabulary's size.
LOGIT_BYTES = {False: 2 + 4 + 4, True: 2}


def n_params(args: LlamaArgs) -> tuple[int, int]:
    """(all parameters, one block's), from the shape alone."""
    d, hd = args.dim, args.head_dim
    block = 2 * d * args.n_heads * hd + 2 * d * args.n_kv_heads * hd + 3 * d * args.hidden_dim + 2 * d
    return 2 * args.vocab_size * d + args.n_layers * block + d, block


@dataclass(frozen=True)
class Float8Memory:
    """What the estimate needs to know of float8, as the float8 seam (trainer/float8_seam) says."""

    # Float8 linears: 1 byte per gathered weight parameter, and their activation bytes.
    linears: bool = False
    # Float8 weight shards kept from one optimizer step to the next (ours, float8.cast_weights_once).
    kept_shards: bool = False
    # Each float8 weight's transposed bytes kept from its layer's forward to its backward (ours, rowwise
    # weights read as stored on the one-GPU fast path).
    weights_for_backward: bool = False


@dataclass(frozen=True)
class MemoryEstimate:
    state: float  # bytes: weights + AdamW + one gathered block
    activations: float  # bytes: saved activations + logits + attention's O(S^2) parts
    grads: float  # bytes
    batch_size: int
    seq_len: int
    ac_mode: str

    @property
    def total(self) -> float:
        return self.state + max(self.activations, self.grads)

    def summary(self) -> str:
        return (
            f"{self.total / GIB:.1f} GiB per GPU (state {self.state / GIB:.1f}, activations "
            f"{self.activations / GIB:.1f}, grads {self.grads / GIB:.1f} reuse freed activations)"
        )


def estimate(
    args: LlamaArgs, *, batch_size: int, seq_len: int, ac_mode: str, float8: bool, param_bytes: int = 2,
    dp: int = 1, tp: int = 1, packed: bool = False, device_type: str = "cuda", attention_kernel: str = "sdpa",
    loss_parallel: bool = True, kept_float8_shards: bool = False, loss_compiled: bool = False,
    float8_weights_for_backward: bool = False,
) -> MemoryEstimate:
    """The peak memory per GPU of one micro-batch (the formula in the module docstring)."""
    total_params, block_params = n_params(args)
    shards = max(dp, 1) * max(tp, 1)
    state = total_params * (4 + 8) / shards + block_params * (1 if float8 else param_bytes)
    if kept_float8_shards:
        state += args.n_layers * block_params / shards
    grads = total_params * 4 / shards
    tokens = batch_size * seq_len / max(tp, 1)
    scale = param_bytes / 2
    if ac_mode == "full":
        c_none = ACTIVATION_BYTES[("none", float8)]
        layers = tokens * args.dim * (args.n_layers * FULL_AC_BLOCK_INPUT_BYTES + c_none) * scale
    else:
        layers = args.n_layers * tokens * args.dim * ACTIVATION_BYTES[(ac_mode, float8)] * scale
    if float8_weights_for_backward:
        layers += (1 if ac_mode == "full" else args.n_layers) * block_params / max(tp, 1)
    # Without loss parallel every TP rank holds the whole batch's full-vocab logits.
    logit_tokens = tokens if loss_parallel else batch_size * seq_len
    logits = logit_tokens * args.vocab_size * LOGIT_BYTES[loss_compiled]
    attention = 0.0
    if packed and attention_kernel == "flex":
        tiles = -(-seq_len // FLEX_BLOCK_SIZE)
        attention += 4 * batch_size * tiles * tiles * 4
    elif packed:
        attention += batch_size * seq_len * seq_len
    if device_type == "cpu":
        attention += batch_size * (args.n_heads / max(tp, 1)) * seq_len * seq_len * 4
    return MemoryEstimate(state, layers + logits + attention, grads, batch_size, seq_len, ac_mode)


def estimate_for(
    cfg: Config, args: LlamaArgs, device_type: str, dp: int, tp: int, param_dtype: str, vocab_sharded_logits: bool,
    loss_compiled: bool, float8: Float8Memory,
) -> MemoryEstimate:
    """The estimate for this config; param_dtype is the resolved one ('bfloat16' or 'float32'),
    vocab_sharded_logits whether TP keeps the logits sharded (loss parallel), loss_compiled whether the
    cross-entropy runs compiled, float8 the seam's answer."""
    t = cfg.training
    param_bytes = 4 if param_dtype == "float32" else 2
    return estimate(
        args, batch_size=t.batch_size, seq_len=t.seq_len, ac_mode=cfg.activation_checkpoint.mode,
        float8=float8.linears, param_bytes=param_bytes, dp=dp, tp=tp,
        packed=cfg.data.kind == "sft" and cfg.data.pack, device_type=device_type, attention_kernel=args.attention,
        loss_parallel=vocab_sharded_logits, kept_float8_shards=float8.kept_shards, loss_compiled=loss_compiled,
        float8_weights_for_backward=float8.weights_for_backward,
    )


def capacity(device: torch.device) -> tuple[str, float]:
    """(what, bytes) one process may use: the GPU's memory, or its share of the host's available memory."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.name, float(props.total_memory)
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    n = local_world_size()
    what = "this host's available memory" + (f" shared by {n} processes" if n > 1 else "")
    return what, available / n


def fit_error(est: MemoryEstimate, what: str, capacity_bytes: float) -> str | None:
    """The one-line refusal, with the numbers, when the estimate exceeds USABLE_FRACTION of the capacity."""
    if est.total <= USABLE_FRACTION * capacity_bytes:
        return None
    fix = "lower training.batch_size or training.seq_len"
    fix += ", or set activation_checkpoint.mode = full" if est.ac_mode != "full" else ", or use more GPUs"
    return (
        f"the plan needs about {est.total / GIB:.1f} GiB per GPU (weights and AdamW {est.state / GIB:.1f} GiB "
        f"+ activations {est.activations / GIB:.1f} GiB at batch {est.batch_size} x seq {est.seq_len}, "
        f"activation_checkpoint {est.ac_mode}) but {what} has {capacity_bytes / GIB:.1f} GiB "
        f"(at most {USABLE_FRACTION:.0%} usable); {fix}"
    )


def check_fits(est: MemoryEstimate, device: torch.device, refuse: bool = True) -> str | None:
    """The refusal when `est` cannot fit `device`: raised as a UserError with refuse (the default), else returned."""
    error = fit_error(est, *capacity(device))
    if error and refuse:
        raise UserError(error)
    return error
