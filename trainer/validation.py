"""Held-out loss, perplexity and (SFT) response-token accuracy, evaluated during training.

The evaluation runs the training model as it is laid out (FSDP, TP, compiled blocks, float8)
in eval mode, with grad mode on but no backward: the compiled blocks then run the code compiled
for training instead of compiling a second, no-grad version, and torch (2.11 and 2.13) cannot
run a no-grad forward of tensor-parallel compiled blocks ("'Tensor' object has no attribute
'elem'"). Each batch's graph is freed with its loss, so the peak is a training forward's. Its batches come from a loader over `validation.path` built
like the training loader, restarted for every evaluation: the same global batches each time,
split over DP ranks like training batches, so the numbers do not depend on the DP degree.
Sums are reduced over the DP ranks; TP ranks compute the same values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import ValidationConfig
from trainer.log import info
from trainer.loss import IGNORE_INDEX, Loss


class Validator:
    """Evaluates `cfg.steps` batches of `loader` (0: the whole held-out set) when `due(step)`.

    A loader with a dataset state (the trainer's) is put back to its start before each
    evaluation, so every evaluation reads the same batches; the whole set is every global batch
    that ends inside the data's first pass (at least one), as the dataset's `epoch` says.
    """

    def __init__(
        self, cfg: ValidationConfig, loader: Iterable[dict[str, torch.Tensor]], last_step: int, *,
        device: torch.device, dp_group: dist.ProcessGroup, loss: Loss, accuracy: bool,
    ) -> None:
        self.cfg = cfg
        self.loader = loader
        self.last_step = last_step
        self.device = device
        self.dp_group = dp_group
        self.loss = loss
        self.accuracy = accuracy
        dataset = getattr(loader, "dataset", None)
        self._dataset = dataset if hasattr(dataset, "load_state_dict") else None
        self._start = self._dataset.state_dict() if self._dataset is not None else None

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0 or step == self.last_step

    def evaluate(self, model: nn.Module, step: int) -> dict[str, float]:
        """validation/loss, validation/perplexity, validation/accuracy (SFT) and validation/time_s, also printed."""
        start = time.perf_counter()
        model.eval()
        # loss sum, target tokens, correct argmax predictions: float64 keeps the counts exact.
        totals = torch.zeros(3, device=self.device, dtype=torch.float64)
        try:
            for batch in self._batches():
                batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
                totals += self._sums(model, batch)
        finally:
            model.train()
        dist.all_reduce(totals, group=self.dp_group)
        loss_sum, n_tokens, correct = totals.tolist()
        loss = loss_sum / max(n_tokens, 1.0)
        record = {"validation/loss": loss, "validation/perplexity": math.exp(min(loss, 700.0))}
        if self.accuracy:
            record["validation/accuracy"] = correct / max(n_tokens, 1.0)
        record["validation/time_s"] = time.perf_counter() - start
        accuracy = f"  accuracy {record['validation/accuracy']:.4f}" if self.accuracy else ""
        info(f"validation step {step}: loss {loss:.4f}  perplexity {record['validation/perplexity']:.2f}"
             f"{accuracy}  ({record['validation/time_s']:.1f}s)")
        return record

    def _batches(self) -> Iterable[dict[str, torch.Tensor]]:
        if self._dataset is not None:
            self._dataset.load_state_dict(self._start)
        batches = iter(self.loader)
        if self.cfg.steps:
            for _ in range(self.cfg.steps):
                yield next(batches)
            return
        for i, batch in enumerate(batches):
            if i > 0 and self._dataset is not None and _past_first_pass(self._dataset.stats()):
                return
            yield batch

    def _sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch["labels"]
        targets = labels != IGNORE_INDEX
        with self.loss.context():
            logits, loss_sum = self.loss(model, batch)
        correct = torch.zeros((), device=self.device)
        if self.accuracy:
            # Vocab-sharded logits are gathered for the argmax: only at evaluation, without grads.
            whole = (logits.full_tensor() if isinstance(logits, DTensor) else logits).detach()
            correct = ((whole.argmax(-1) == labels) & targets).sum()
        return torch.stack([loss_sum.detach().double(), targets.sum().double(), correct.double()])


def _past_first_pass(stats: dict[str, int]) -> bool:
    """The dataset has wrapped around: its epoch, or for a mixture any source's, is past the first."""
    return any(value > 0 for key, value in stats.items() if key == "epoch" or key.endswith("/epoch"))
