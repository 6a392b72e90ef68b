"""Validation during training: the Validator's sums, and validation in real runs across layouts."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.config import ValidationConfig
from trainer.validation import Validator


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(tokens))


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, 11, (2, 7), generator=g)
        labels = torch.randint(0, 11, (2, 7), generator=g)
        labels[0, :3] = -100  # prompt tokens carry no loss
        out.append({"input_ids": tokens, "labels": labels})
    return out


def test_loss_perplexity_and_accuracy_are_token_means_over_the_first_steps_batches(one_process_group):
    torch.manual_seed(0)
    model = TinyLM()
    batches = _batches(5)
    validator = Validator(
        ValidationConfig(enable=True, path="x", freq=3, steps=4), batches, last_step=10,
        device=torch.device("cpu"), dp_group=one_process_group, vocab_sharded_logits=False, accuracy=True,
    )
    record = validator.evaluate(model)
    logits = torch.cat([model(b["input_ids"]) for b in batches[:4]]).flatten(0, 1)
    labels = torch.cat([b["labels"] for b in batches[:4]]).flatten()
    keep = labels != -100
    expected = F.cross_entropy(logits[keep].double(), labels[keep]).item()
    assert record["validation/loss"] == pytest.approx(expected, rel=1e-6)
    assert record["validation/perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    accuracy = (logits.argmax(-1)[keep] == labels[keep]).double().mean().item()
    assert record["validation/accuracy"] == pytest.approx(accuracy, abs=1e-12)
    assert 0 < record["validation/time_s"] < 60
    assert model.training, "the model must be back in train mode"
    again = validator.evaluate(model)
    assert again["validation/loss"] == record["validation/loss"]
    assert [validator.due(s) for s in (1, 3, 5, 6, 9, 10)] == [False, True, False, True, True, True]


def test_pretraining_validation_has_no_accuracy(one_process_group):
    validator = Validator(
        ValidationConfig(enable=True, path="x", steps=2), _batches(2), last_step=4,
        device=torch.device("cpu"), dp_group=one_process_group, vocab_sharded_logits=False, accuracy=False,
    )
    assert set(validator.evaluate(TinyLM())) == {"validation/loss", "validation/perplexity", "validation/time_s"}
