"""Per-GEMM SQNR of the float8 recipes against fp32 on a model's layer shapes, with operands from a real step.

One bf16 forward + backward of a LLaMA-2 (the given number of layers), freshly initialised or
with a checkpoint's weights (a trained model's activations have the outliers per-tile scales are
for), on tokens of a corpus captures every linear's input x, weight w and output gradient g.
Each linear is then run again as a Float8Linear of each recipe on exactly those x, w and g, and
each of its three GEMMs' results (out = x w^T, grad_x = g w, grad_w = g^T x) is compared with the
same GEMM in fp32. Issue #40's bar: blockwise at least 4 dB above tensorwise in both backward
GEMMs on every linear. `scripts/check_float8.py --model-gemms` prints it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import nn

from float8 import Float8Config, Float8Linear
from models.llama import LLAMA2_FLAVORS, LlamaArgs
from models.llama.model import initialized_model
from models.llama.weight_conversion import WeightsError
from models.llama.weight_files import read_weights
from trainer.checkpoint.dcp_reader import load_dcp_model
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

GEMMS = ("output", "grad_input", "grad_weight")
MARGIN_DB = 4.0


def sqnr(ref: torch.Tensor, actual: torch.Tensor | None) -> float:
    """SQNR of `actual` against `ref` in dB; -inf where there is no result (a missing gradient)."""
    if actual is None:
        return float("-inf")
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm().clamp(min=1e-30))).item()


def corpus_tokens(path: Path, tokenizer: Tokenizer, count: int) -> torch.Tensor:
    ids: list[int] = []
    for file in sorted(path.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            ids += tokenizer.encode(json.loads(line)["text"], bos=True, eos=True)
            if len(ids) >= count:
                return torch.tensor(ids[:count])
    raise UserError(f"{path} holds fewer than {count} tokens")


def load_weights(model: nn.Module, args: LlamaArgs, path: Path) -> None:
    """`path`'s weights into `model`: a DCP folder (a training step's or a model-only one) or a model
    file in our names (`checkpoint.export_final`'s model.safetensors, a torch state dict)."""
    if path.is_dir():
        load_dcp_model(model, path, "--checkpoint")
        return
    try:
        _, state_dict = read_weights("torch", path, args)
    except (WeightsError, OSError) as e:
        raise UserError(f"--checkpoint: {e}") from None
    model.load_state_dict(state_dict)


def capture(model: nn.Module, tokens: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """name -> (x, w, g) of every linear of the blocks, from one bf16 forward + backward."""
    seen: dict[str, list[torch.Tensor]] = {}

    def forward_hook(name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            seen[name] = [inputs[0].detach(), module.weight.detach()]
        return hook

    def backward_hook(name: str):
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            seen[name].append(grad_output[0].detach())
        return hook

    hooks = []
    for name, module in model.layers.named_modules():
        if isinstance(module, nn.Linear):
            hooks += [module.register_forward_hook(forward_hook(name)), module.register_full_backward_hook(backward_hook(name))]
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    for hook in hooks:
        hook.remove()
    return {name: tuple(v) for name, v in seen.items()}


def gemm_sqnrs(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, recipe: str) -> list[float]:
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    exact = (x2.float() @ w.float().t(), g2.float() @ w.float(), g2.float().t() @ x2.float())
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    linear.weight = nn.Parameter(w.clone())
    f8 = Float8Linear.from_float(linear, Float8Config(scaling=recipe))
    xi = x2.clone().requires_grad_()
    out = f8(xi)
    out.backward(g2)
    return [sqnr(e, a) for e, a in zip(exact, (out, xi.grad, f8.weight.grad))]


def sqnr_table(opts) -> dict[str, dict[str, list[float]]]:
    """linear name -> recipe -> SQNR (dB) of its output, grad_input and grad_weight GEMMs."""
    device = torch.device(opts.device)
    tokenizer = Tokenizer(opts.tokenizer)
    args = dataclasses.replace(LLAMA2_FLAVORS[opts.flavor], n_layers=opts.layers,
                               vocab_size=opts.vocab_size or tokenizer.n_words,
                               max_seq_len=opts.seq + 1)
    model = initialized_model(args, seed=42, device=device)
    if opts.checkpoint:
        load_weights(model, args, Path(opts.checkpoint))
    model = model.to(torch.bfloat16)
    tokens = corpus_tokens(Path(opts.corpus), tokenizer, opts.batch * (opts.seq + 1)).view(opts.batch, -1).to(device)
    operands = capture(model, tokens)
    del model
    return {name: {r: gemm_sqnrs(*xwg, r) for r in opts.recipes} for name, xwg in operands.items()}


def print_table(table: dict[str, dict[str, list[float]]], recipes: list[str]) -> list[str]:
    """Prints the table; returns the backward GEMMs where blockwise misses tensorwise + MARGIN_DB."""
    print(f"{'linear':32} {'GEMM':12}" + "".join(f"{r:>12}" for r in recipes) + "   blockwise - tensorwise")
    both = {"blockwise", "tensorwise"} <= set(recipes)
    missed = []
    for name, by_recipe in table.items():
        for i, gemm in enumerate(GEMMS):
            dbs = [by_recipe[r][i] for r in recipes]
            gain = by_recipe["blockwise"][i] - by_recipe["tensorwise"][i] if both else float("nan")
            if both and gemm != "output" and gain < MARGIN_DB:
                missed.append(f"{name} {gemm} (+{gain:.1f} dB)")
            print(f"{name:32} {gemm:12}" + "".join(f"{db:12.1f}" for db in dbs) + f"   {gain:+.1f}")
    for i, gemm in enumerate(GEMMS):
        print(f"{'min over linears':32} {gemm:12}" + "".join(f"{min(t[r][i] for t in table.values()):12.1f}" for r in recipes))
    return missed
