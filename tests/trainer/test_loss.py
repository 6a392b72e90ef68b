"""trainer/loss.py: the compiled cross-entropy is the eager one, and the plan says where it runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from models.llama import LLAMA2_FLAVORS
from trainer.config import build_config
from trainer.data.windows import IGNORE_INDEX
from trainer.distributed.memory_plan import estimate
from trainer.loss import Loss, choose_loss_compile
from trainer.plan import RunPlan


class _Logits(nn.Module):
    """Token ids -> (B, S, vocab) bf16 logits through one embedding: a model as the loss sees it."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, vocab, dtype=torch.bfloat16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * 4


def _loss_and_grad(loss: Loss, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = _Logits(384)
    with loss.context():
        _, summed = loss(model, batch)
        summed.backward()
    return summed.detach(), model.embed.weight.grad


def test_the_compiled_loss_is_the_eager_one():
    torch.manual_seed(1)
    labels = torch.randint(0, 384, (2, 48))
    labels[0, :7] = IGNORE_INDEX
    batch = {"input_ids": torch.randint(0, 384, (2, 48)), "labels": labels}
    eager_loss, eager_grad = _loss_and_grad(Loss(False, None), batch)
    compiled_loss, compiled_grad = _loss_and_grad(Loss(False, "inductor"), batch)
    # Same sum of fp32 token losses (another summation order); bf16 gradients within one bf16 step.
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=2**-7, atol=1e-6)
    assert compiled_grad.dtype == torch.bfloat16 and compiled_grad.abs().sum() > 0


@pytest.mark.parametrize(("mode", "switch", "tp", "compiled", "text"), [
    ("none", "true", 1, False, "none"),
    ("block", "true", 1, True, "block, loss too"),
    ("model", "false", 1, False, "model, loss eager (compile.loss = false)"),
    ("block", "true", 2, False, "block, loss eager (vocab-sharded logits)"),
])
def test_the_plan_compiles_the_loss_with_the_blocks_unless_the_logits_are_vocab_sharded(mode, switch, tp, compiled, text):
    cfg = build_config(["--config", "configs/debug.toml", "--training.device", "cpu", "--compile.mode", mode,
                        "--compile.loss", switch, "--parallelism.tensor_parallel_degree", str(tp)])
    plan = RunPlan.resolve(cfg, tp, load_tokenizer=False)
    assert (plan.loss_compiled, plan.compile_text) == (compiled, text)
    assert choose_loss_compile(mode, switch == "true", tp > 1) == (compiled, text)


def test_the_compiled_loss_keeps_only_the_bf16_logits_in_the_estimate():
    args = LLAMA2_FLAVORS["7B"]
    eager, compiled = (estimate(args, batch_size=2, seq_len=4096, ac_mode="none", float8=True, loss_compiled=c)
                       for c in (False, True))
    assert eager.activations - compiled.activations == pytest.approx(2 * 4096 * args.vocab_size * 8)
