"""The loss, one function for training and validation: cross-entropy summed over target tokens,
for whole or vocab-sharded logits.

With tensor parallelism and `parallelism.loss_parallel` the output projection leaves the
logits as a DTensor sharded on the vocab dim (trainer/distributed/parallelize.py). Under
`torch.distributed.tensor.parallel.loss_parallel` the cross-entropy then reduces the
softmax statistics across the TP ranks instead of gathering (batch x seq x vocab) logits
on every rank; its backward must run under the same context, hence `loss_context`.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from trainer.data.windows import IGNORE_INDEX


def loss_context(vocab_sharded: bool) -> contextlib.AbstractContextManager:
    """The context the loss and its backward run in: loss_parallel for vocab-sharded logits."""
    return loss_parallel() if vocab_sharded else contextlib.nullcontext()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token losses of (B, S, vocab) logits against (B, S) labels, skipping IGNORE_INDEX.

    Computed in fp32. Vocab-sharded DTensor logits must come under `loss_context(True)`;
    the result is a plain scalar tensor either way.
    """
    loss = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits for `batch` and their `cross_entropy_sum` against its labels: the loss a training
    step backpropagates and validation reports (both under `loss_context`)."""
    # Packed SFT batches carry their documents' positions and ids (the attention mask).
    kwargs = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
    logits = model(batch["input_ids"], **kwargs)
    return logits, cross_entropy_sum(logits, batch["labels"])
