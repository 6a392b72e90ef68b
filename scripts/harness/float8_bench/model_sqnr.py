"""Per-GEMM SQNR of the float8 recipes against fp32 on LLaMA-2-7B layer shapes, with operands from a real step.

    python scripts/check_blockwise_sqnr.py [--layers 2] [--batch 2] [--seq 4096] [--recipes tensorwise,rowwise,blockwise]

One bf16 forward + backward of a freshly initialised LLaMA-2-7B (the given number of layers) on
tokens of the shipped corpus captures every linear's input x, weight w and output gradient g.
Each linear is then run again as a Float8Linear of each recipe on exactly those x, w and g, and
each of its three GEMMs' results (out = x w^T, grad_x = g w, grad_w = g^T x) is compared with the
same GEMM in fp32: SQNR in dB, per layer and the minimum over layers. Issue #40's bar: blockwise
at least 4 dB above tensorwise in both backward GEMMs (grad_input, grad_weight) on every linear;
exit 1 where it is missed. Needs a GPU with block-scaled float8 GEMMs (sm_90); on a CPU
(`--device cpu --flavor debug`) the GEMMs are emulated, a smoke test of the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from float8 import Float8Config, Float8Linear
from models.llama import LLAMA2_FLAVORS
from models.llama.model import initialized_model
from trainer.data.tokenizer import Tokenizer

GEMMS = ("output", "grad_input", "grad_weight")
MARGIN_DB = 4.0


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm().clamp(min=1e-30))).item()


def corpus_tokens(path: Path, tokenizer: Tokenizer, count: int) -> torch.Tensor:
    ids: list[int] = []
    for file in sorted(path.glob("*.jsonl")):
        for line in file.read_text().splitlines():
            ids += tokenizer.encode(json.loads(line)["text"], bos=True, eos=True)
            if len(ids) >= count:
                return torch.tensor(ids[:count])
    raise SystemExit(f"{path} holds fewer than {count} tokens")


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--recipes", default="tensorwise,rowwise,blockwise")
    parser.add_argument("--corpus", default="data/corpus")
    parser.add_argument("--tokenizer", default="data/tokenizer.model")
    parser.add_argument("--out", help="write the table as JSON here")
    parser.add_argument("--flavor", default="7B", help="model shapes (debug with --device cpu: a smoke test)")
    parser.add_argument("--device", default="cuda")
    opts = parser.parse_args()
    recipes = opts.recipes.split(",")
    device = torch.device(opts.device)
    tokenizer = Tokenizer(opts.tokenizer)
    args = dataclasses.replace(LLAMA2_FLAVORS[opts.flavor], n_layers=opts.layers, vocab_size=tokenizer.n_words,
                               max_seq_len=opts.seq + 1)
    model = initialized_model(args, seed=42, device=device).to(torch.bfloat16)
    tokens = corpus_tokens(Path(opts.corpus), tokenizer, opts.batch * (opts.seq + 1)).view(opts.batch, -1).to(device)
    operands = capture(model, tokens)
    del model
    table = {name: {r: gemm_sqnrs(*xwg, r) for r in recipes} for name, xwg in operands.items()}
    print(f"{'linear':32} {'GEMM':12}" + "".join(f"{r:>12}" for r in recipes) + "   blockwise - tensorwise")
    missed = []
    for name, by_recipe in table.items():
        for i, gemm in enumerate(GEMMS):
            dbs = [by_recipe[r][i] for r in recipes]
            gain = by_recipe["blockwise"][i] - by_recipe["tensorwise"][i] if {"blockwise", "tensorwise"} <= set(recipes) else float("nan")
            if gemm != "output" and gain < MARGIN_DB:
                missed.append(f"{name} {gemm} (+{gain:.1f} dB)")
            print(f"{name:32} {gemm:12}" + "".join(f"{db:12.1f}" for db in dbs) + f"   {gain:+.1f}")
    for i, gemm in enumerate(GEMMS):
        print(f"{'min over linears':32} {gemm:12}" + "".join(f"{min(t[r][i] for t in table.values()):12.1f}" for r in recipes))
    if opts.out:
        Path(opts.out).write_text(json.dumps({"args": vars(opts), "sqnr_db": table, "missed": missed}, indent=1))
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}: "
          + (f"blockwise below tensorwise + {MARGIN_DB:g} dB in {len(missed)}: {'; '.join(missed)}" if missed
             else f"blockwise >= tensorwise + {MARGIN_DB:g} dB in every backward GEMM"))
    return 1 if missed else 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
