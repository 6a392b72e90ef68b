"""The loss, one function for training and validation: cross-entropy summed over target tokens,
for whole or vocab-sharded logits.

With tensor parallelism and `parallelism.loss_parallel` the output projection leaves the
logits as a DTensor sharded on the vocab dim (trainer/distributed/parallelize.py). Under
`torch.distributed.tensor.parallel.loss_parallel` the cross-entropy then reduces the
softmax statistics across the TP ranks instead of gathering (batch x seq x vocab) logits
on every rank; its backward must run under the same context, hence `Loss.context`.

Eager, the cross-entropy upcasts the (tokens x vocab) logits to fp32 and keeps an fp32 log-softmax
for its backward: 8 bytes per logit beside the bf16 logits. Compiled (`compile.loss`, on with any
`compile.mode` but "none"), the upcast, softmax and gather fuse into one reduction forward and one
backward that writes the bf16 gradient straight: the same loss to fp32 rounding, nothing of the
vocabulary's size kept beyond the logits (for 8,192 x 32,000 logits on an H100: 0.8 ms of kernels
against 4.4, and 1.96 GiB less at peak; docs/benchmarks.md). Vocab-sharded logits (DTensors) stay eager.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.data.windows import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses of (B, S, vocab) logits against (B, S) labels, skipping IGNORE_INDEX.

    Computed in fp32. Vocab-sharded DTensor logits must come under `Loss.context()`;
    the result is a plain scalar tensor either way.
    """
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def choose_loss_compile(compile_mode: str, compile_loss: bool, vocab_sharded: bool) -> tuple[bool, str]:
    """(whether the loss runs compiled, compile.mode as the startup summary and dry run print it)."""
    if compile_mode == "none":
        return False, compile_mode
    if not compile_loss:
        return False, f"{compile_mode}, loss eager (compile.loss = false)"
    if vocab_sharded:
        return False, f"{compile_mode}, loss eager (vocab-sharded logits)"
    return True, f"{compile_mode}, loss too"


class Loss:
    """A run's loss: `cross_entropy_sum` of the model's logits, torch.compile'd with `compile_backend` when
    one is given (trainer/plan.py decides: `RunPlan.loss_compiled`), under `context()`. Training and
    validation call the same one."""

    def __init__(self, vocab_sharded: bool, compile_backend: str | None) -> None:
        self.vocab_sharded = vocab_sharded
        self._sum = cross_entropy_sum if compile_backend is None else \
            torch.compile(cross_entropy_sum, backend=compile_backend, fullgraph=True)

    def context(self) -> contextlib.AbstractContextManager:
        """The context the loss and its backward run in: loss_parallel for vocab-sharded logits."""
        return loss_parallel() if self.vocab_sharded else contextlib.nullcontext()

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's logits for `batch` and their summed loss against its labels."""
        # Packed SFT batches carry their documents' positions and ids (the attention mask).
        kwargs = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        logits = model(batch["input_ids"], **kwargs)
        return logits, self._sum(logits, batch["labels"])
