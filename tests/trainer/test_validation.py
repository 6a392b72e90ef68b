"""Validation during training: the Validator's sums, and validation in real runs across layouts."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers import read_metrics, run_train
from trainer.config import ValidationConfig
from trainer.loss import Loss
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
        device=torch.device("cpu"), dp_group=one_process_group, loss=Loss(False, None), accuracy=True,
    )
    record = validator.evaluate(model, 3)
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
    again = validator.evaluate(model, 3)
    assert again["validation/loss"] == record["validation/loss"]
    assert [validator.due(s) for s in (1, 3, 5, 6, 9, 10)] == [False, True, False, True, True, True]


def test_pretraining_validation_has_no_accuracy(one_process_group):
    validator = Validator(
        ValidationConfig(enable=True, path="x", steps=2), _batches(2), last_step=4,
        device=torch.device("cpu"), dp_group=one_process_group, loss=Loss(False, None), accuracy=False,
    )
    assert set(validator.evaluate(TinyLM(), 2)) == {"validation/loss", "validation/perplexity", "validation/time_s"}


VALIDATED = [
    "--model.n_layers", "2", "--training.seq_len", "64", "--training.steps", "4", "--metrics.log_freq", "3",
    "--metrics.enable_tensorboard", "false", "--validation.enable", "true", "--validation.path", "data/heldout",
    "--validation.freq", "2", "--validation.steps", "2",
]


def _validation(dump) -> dict[int, float]:
    return {r["step"]: r["validation/loss"] for r in read_metrics(dump) if "validation/loss" in r}


@pytest.mark.slow
def test_validation_loss_is_the_same_across_layouts(tmp_path):
    """Same weights and held-out batches: the evaluation must not depend on FSDP, TP or compile."""
    runs = {
        "single": ([*VALIDATED, "--training.batch_size", "8"], 1),
        "fsdp": ([*VALIDATED, "--training.batch_size", "4"], 2),
        # aot_eager: the evaluation's own no-grad graphs are traced under TP as inductor would be
        # given them; inductor's lowering of TP blocks is tests/trainer/distributed/test_parallel_compile.py's subject.
        "tp_compiled": ([*VALIDATED, "--training.batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                         "--compile.mode", "block", "--compile.backend", "aot_eager"], 2),
    }
    losses = {}
    for name, (args, nproc) in runs.items():
        result = run_train([*args, "--job.dump_folder", str(tmp_path / name)], nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        losses[name] = _validation(tmp_path / name)
        # Logged at every evaluation step, also where log_freq would not log.
        assert sorted(losses[name]) == [2, 4], losses[name]
        assert result.stdout.count("validation step ") == 2, result.stdout[-2000:]
    for name in ("fsdp", "tp_compiled"):
        for step in (2, 4):
            assert losses[name][step] == pytest.approx(losses["single"][step], rel=1e-2), (name, step, losses)
    assert losses["single"][4] < losses["single"][2], "held-out loss must fall while training"
    # Evaluating (a forward without backward between steps) must leave training untouched.
    plain = tmp_path / "fsdp_without_validation"
    args, nproc = runs["fsdp"]
    result = run_train([*args, "--validation.enable", "false", "--job.dump_folder", str(plain)], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    trained = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / "fsdp")}
    untouched = {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(plain)}
    assert sorted(untouched) == [1, 3, 4] and {s: trained[s] for s in untouched} == untouched


@pytest.mark.slow
def test_sft_validation_reports_response_accuracy(tmp_path):
    result = run_train([
        "--config", "configs/debug_sft.toml", *VALIDATED[:-6], "--validation.path", "data/sft/eval.jsonl",
        "--validation.freq", "4", "--validation.steps", "1", "--training.batch_size", "2",
        "--checkpoint.enable", "false", "--job.dump_folder", str(tmp_path),
    ])
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = [r for r in read_metrics(tmp_path) if "validation/loss" in r]
    assert row["step"] == 4
    assert row["validation/perplexity"] == pytest.approx(math.exp(row["validation/loss"]), rel=1e-9)
    # Accuracy of a 4-step model over a vocabulary of 32,000: a fraction, printed as logged.
    accuracy = row["validation/accuracy"]
    assert 0 < accuracy < 1
    assert f"accuracy {accuracy:.4f}" in result.stdout


@pytest.mark.slow
def test_validation_without_a_path_is_one_line(tmp_path):
    result = run_train(["--validation.enable", "true", "--validation.path", "", "--job.dump_folder", str(tmp_path)])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: validation.enable = true needs validation.path or [[validation.sources]] "
        "(held-out data in data.path's formats)"
    ]


def test_every_evaluation_reads_the_same_batches_of_its_loader(one_process_group):
    """A real held-out loader (here a mixture of two sources) restarts for every evaluation."""
    from trainer.config import SourceConfig
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import Tokenizer

    tok = Tokenizer("data/tokenizer.model")
    loader = build_dataloader(
        kind="pretrain", path="", tokenizer=tok, seq_len=16, batch_size=2, dp_rank=0, dp_degree=1, seed=0,
        option="validation.path", sources=[SourceConfig(path="data/heldout", weight=1),
                                           SourceConfig(path="data/corpus/train-00000.jsonl", weight=1)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(tok.n_words, 8), nn.Linear(8, tok.n_words))
    validator = Validator(
        ValidationConfig(enable=True, freq=1, steps=3), loader, last_step=4, device=torch.device("cpu"),
        dp_group=one_process_group, loss=Loss(False, None), accuracy=False,
    )
    first = validator.evaluate(model, 1)["validation/loss"]
    assert validator.evaluate(model, 2)["validation/loss"] == first
    assert loader.dataset.stats()["windows"] == 6


def test_every_evaluation_reads_the_same_batches_and_0_steps_the_whole_set(one_process_group):
    from trainer.data.loader import build_dataloader
    from trainer.data.tokenizer import Tokenizer

    tokenizer = Tokenizer("data/tokenizer.model")

    def validator(steps: int) -> Validator:
        loader = build_dataloader(kind="pretrain", path="data/heldout", tokenizer=tokenizer, seq_len=512,
                                  batch_size=2, dp_rank=0, dp_degree=1, seed=0)
        return Validator(ValidationConfig(enable=True, path="data/heldout", steps=steps), loader, last_step=4,
                         device=torch.device("cpu"), dp_group=one_process_group, loss=Loss(False, None),
                         accuracy=False)

    torch.manual_seed(0)
    model = TinyLM(vocab=tokenizer.n_words)
    some = validator(2)
    assert some.evaluate(model, 1)["validation/loss"] == some.evaluate(model, 2)["validation/loss"]
    whole = validator(0)
    first = [b["input_ids"] for b in whole._batches()]
    again = [b["input_ids"] for b in whole._batches()]
    # The whole first pass: every full batch of 2 x 513-token windows, no wrapped-around one.
    windows = whole._dataset.stats()["windows"] - 2  # the loader had read one batch past the pass
    assert len(first) == windows // 2 > 2 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert whole.evaluate(model, 1)["validation/loss"] == whole.evaluate(model, 2)["validation/loss"]
