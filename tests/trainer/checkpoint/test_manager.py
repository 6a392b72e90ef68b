"""CheckpointManager in-process, without the Trainer or subprocesses: a tiny float32 LLaMA, AdamW,
the LR schedule and the shipped corpus's loader under a gloo process group of one rank."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from models.llama import LLAMA2_FLAVORS, Transformer
from tests.helpers import ROOT
from trainer.checkpoint.context import CheckpointContext
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.schema import schedule_values
from trainer.config import CheckpointConfig, Config, OptimizerConfig
from trainer.data.loader import build_dataloader
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.train_state import TrainState

ARGS = dataclasses.replace(LLAMA2_FLAVORS["debug"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
BATCH, SEQ_LEN, STEPS = 2, 32, 4


@pytest.fixture(autouse=True)
def one_rank_group() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(ROOT / "data" / "tokenizer.model"))


class Run:
    """What the Trainer hands a CheckpointManager, and a plain training step to move it along."""

    def __init__(self, folder: Path, tokenizer: Tokenizer, seed: int, **checkpoint: object) -> None:
        torch.manual_seed(seed)
        self.model = Transformer(ARGS)
        with torch.no_grad():
            self.model.init_weights()
        cfg = Config()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, STEPS)
        self.dataloader = build_dataloader(
            kind="pretrain", path=str(ROOT / "data" / "corpus"), tokenizer=tokenizer, seq_len=SEQ_LEN,
            batch_size=BATCH, dp_rank=0, dp_degree=1, seed=0,
        )
        self.state = TrainState()
        self.optimizer_config = OptimizerConfig()
        context = CheckpointContext(
            config=CheckpointConfig(enable=True, interval=1, **checkpoint), folder=folder, rank=0, world_size=1,
            device=torch.device("cpu"), dp=1, tp=1, global_batch=BATCH, training_steps=STEPS,
            schedule=schedule_values(cfg.lr_scheduler, cfg.training.steps), optimizer=self.optimizer_config, model_args=ARGS,
        )
        self.manager = CheckpointManager(
            model=self.model, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, dataloader=self.dataloader,
            train_state=self.state, context=context,
        )
        self._batches: Iterator[dict[str, torch.Tensor]] | None = None

    def start(self) -> bool:
        resumed = self.manager.load_latest()
        self._batches = iter(self.dataloader)
        return resumed

    def step(self) -> float:
        """One optimizer step, then maybe_save as the Trainer calls it; the step's loss."""
        batch = next(self._batches)
        data_state = self.dataloader.state_dict()
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(0, 1))
        loss.backward()
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.tokens_seen += BATCH * SEQ_LEN
        self.manager.maybe_save(data_state, force=self.state.step == STEPS)
        return loss.item()

    def params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_save_writes_complete_checkpoints_and_keeps_the_latest_k(tmp_path, tokenizer):
    run = Run(tmp_path, tokenizer, seed=0, keep_latest_k=2)
    assert run.start() is False
    for _ in range(STEPS):
        run.step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3", "step-4"]
    step4 = tmp_path / "step-4"
    assert {p.name for p in step4.iterdir()} >= {".metadata", "extra.json", "rng", "checksums.json"}
    assert (step4 / "rng" / "rank-0.safetensors").is_file()
    extra = json.loads((step4 / "extra.json").read_text())
    assert extra["train_state"] == {"step": 4, "tokens_seen": 4 * BATCH * SEQ_LEN}
    assert extra["lr_scheduler"]["last_epoch"] == 4
    assert (extra["global_batch"], extra["world_size"], extra["dp"], extra["tp"]) == (BATCH, 1, 1, 1)
    assert extra["dataloader"]["dataset_state"]["windows"] == 4 * BATCH


@pytest.mark.slow
@pytest.mark.version_specific
def test_resume_restores_model_optimizer_schedule_and_loader_bitwise(tmp_path, tokenizer):
    """Steps 3 and 4 resumed from step-2 give the losses and weights of one uninterrupted run."""
    reference = Run(tmp_path, tokenizer, seed=0)
    reference.start()
    losses = [reference.step() for _ in range(STEPS)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2", "step-3", "step-4"]

    # Another seed: whatever matches the reference below was loaded, not initialised alike.
    resumed = Run(tmp_path, tokenizer, seed=1, load_step=2)
    assert resumed.start() is True
    assert resumed.manager.last_loaded == tmp_path / "step-2"
    assert (resumed.state.step, resumed.state.tokens_seen) == (2, 2 * BATCH * SEQ_LEN)
    assert resumed.lr_scheduler.last_epoch == 2
    assert [resumed.step() for _ in range(2)] == losses[2:]
    assert_bitwise_equal(resumed.params(), reference.params())

    latest = Run(tmp_path, tokenizer, seed=1)
    assert latest.start() is True
    assert latest.manager.last_loaded == tmp_path / "step-4"
    assert latest.state.step == 4
    assert_bitwise_equal(latest.params(), reference.params())
    assert latest.optimizer_config.lr == Config().optimizer.lr


def test_save_refuses_nonfinite_weights_and_writes_nothing(tmp_path, tokenizer):
    run = Run(tmp_path, tokenizer, seed=0)
    run.start()
    run.step()
    with torch.no_grad():
        run.model.norm.weight[0] = float("nan")
    run.state.step = 2
    with pytest.raises(UserError, match=r"^step 2: the model holds non-finite weights, so no checkpoint of it is saved; "):
        run.manager.save(2, run.dataloader.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_checksum_mismatch_is_refused_before_anything_loads(tmp_path, tokenizer):
    run = Run(tmp_path, tokenizer, seed=0)
    run.start()
    run.step()
    run.step()
    shard = next((tmp_path / "step-2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    fresh = Run(tmp_path, tokenizer, seed=1)
    before = fresh.params()
    with pytest.raises(UserError, match=(
        rf"^checkpoint {re.escape(str(tmp_path / 'step-2'))}: {re.escape(shard.name)} does not match its checksum .*; "
        r"resume from an older "
        r"checkpoint with checkpoint.load_step = 1 \(older steps: 1\)$"
    )):
        fresh.start()
    assert_bitwise_equal(fresh.params(), before)
    assert fresh.state.step == 0


def test_an_edited_extra_json_names_the_field(tmp_path, tokenizer):
    run = Run(tmp_path, tokenizer, seed=0)
    run.start()
    run.step()
    extra_file = tmp_path / "step-1" / "extra.json"
    extra = json.loads(extra_file.read_text())
    extra["train_state"]["tokens_seen"] = -1
    extra_file.write_text(json.dumps(extra))
    with pytest.raises(UserError, match=(
        rf"^checkpoint {re.escape(str(tmp_path / 'step-1'))}: extra\.json field 'train_state.tokens_seen' must be an integer "
        r">= 0, got -1$"
    )):
        Run(tmp_path, tokenizer, seed=1).start()


def test_load_step_that_does_not_exist(tmp_path, tokenizer):
    (tmp_path / "step-5").mkdir()
    with pytest.raises(UserError, match=r"^checkpoint.load_step = 7: no such checkpoint in .* \(found: 5\)$"):
        Run(tmp_path, tokenizer, seed=0, load_step=7).start()


def test_final_export_holds_the_last_weights(tmp_path, tokenizer):
    run = Run(tmp_path, tokenizer, seed=0, export_final=True, export_dtype="float32")
    run.start()
    run.step()
    run.manager.maybe_export_final()
    assert not (tmp_path / "final").exists()  # a run stopped before training.steps has no final model
    for _ in range(STEPS - 1):
        run.step()
    run.manager.maybe_export_final()
    assert_bitwise_equal(load_file(str(tmp_path / "final" / "model.safetensors")), run.params())
    assert json.loads((tmp_path / "final" / "params.json").read_text())["dim"] == ARGS.dim
