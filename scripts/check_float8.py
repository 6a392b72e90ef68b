"""Check float8 training numerics on this machine's GPU (or CPU) against an fp32 reference.

    python scripts/check_float8.py [--device cuda] [--tokens 4096]
    python scripts/check_float8.py --model-gemms [--layers 2] [--batch 2] [--seq 4096] [--checkpoint PATH [--vocab-size N]] [--out sqnr.json]

For each scaling recipe and each way of running it (eager; eager with unfused casts;
compiled with the aot_eager and inductor backends) prints the SQNR in dB of the
output, the input gradient and the weight gradient of one Float8Linear (bf16) against
an fp32 nn.Linear, and exits 1 if any falls below the thresholds (output >= 25 dB,
gradients >= 20 dB; a run on an H200: docs/benchmarks.md, "Float8 numerics on the GPU"). Use it after upgrading torch or drivers.

With --model-gemms: the SQNR of each GEMM of every linear of a LLaMA-2 (--flavor, --layers) on
operands captured from one real bf16 step (fresh weights, or a trained checkpoint's), per recipe, and exit 1 where blockwise is not at least
4 dB above tensorwise in a backward GEMM (scripts/harness/float8_bench/model_sqnr.py). Needs a GPU
with block-scaled float8 GEMMs (sm_90) for the real GEMMs; `--device cpu --flavor debug` emulates them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

from float8 import RECIPES, Float8Config, Float8Linear
from scripts.harness.float8_bench import model_sqnr

THRESHOLDS = (25.0, 20.0, 20.0)


def run(module: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype):
    xi = x.to(dtype).detach().requires_grad_()
    out = module(xi)
    out.backward(g.to(out.dtype))
    grad_w = module.weight.grad
    return out.float(), xi.grad.float(), None if grad_w is None else grad_w.float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--out-features", type=int, default=1024)
    model = parser.add_argument_group("--model-gemms")
    model.add_argument("--model-gemms", action="store_true", help="per-GEMM SQNR of a model's linears on a real step's operands")
    model.add_argument("--flavor", default="7B", help="model shapes (debug with --device cpu: a smoke test)")
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--batch", type=int, default=2)
    model.add_argument("--seq", type=int, default=4096)
    model.add_argument("--recipes", default="tensorwise,rowwise,blockwise", type=lambda s: s.split(","))
    model.add_argument("--corpus", default="data/corpus")
    model.add_argument("--tokenizer", default="data/tokenizer.model")
    model.add_argument("--vocab-size", type=int, default=None,
                       help="the model's vocabulary (default: the tokenizer's); a checkpoint's model.vocab_size")
    model.add_argument("--checkpoint", help="the model's weights instead of a fresh init: a DCP folder (a training "
                                            "step's or a model-only one) or a model file (checkpoint.export_final's "
                                            "model.safetensors); --flavor, --layers and --vocab-size (default: the tokenizer's) "
                                            "must match it")
    model.add_argument("--out", help="write the table as JSON here")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if opts.model_gemms:
        return check_model_gemms(opts, device)
    torch.manual_seed(0)
    ref = nn.Linear(opts.in_features, opts.out_features, bias=False, device=device)
    x = torch.randn(opts.tokens, opts.in_features, device=device)
    g = torch.randn(opts.tokens, opts.out_features, device=device)
    expected = run(ref, x, g, torch.float32)
    variants = [("eager", None, True), ("eager-unfused", None, False),
                ("compiled-aot_eager", "aot_eager", True), ("compiled-inductor", "inductor", True),
                ("compiled-unfused", "inductor", False)]
    failures = 0
    print(f"{'scaling':14} {'variant':20} {'out dB':>8} {'grad_x dB':>10} {'grad_w dB':>10}")
    for scaling in RECIPES:
        for name, backend, fused in variants:
            torch._dynamo.reset()
            config = Float8Config(scaling=scaling, eager_casts="auto" if fused else "plain")
            f8 = Float8Linear.from_float(copy.deepcopy(ref).to(torch.bfloat16), config)
            if backend:
                f8.compile(backend=backend, fullgraph=True)
            got = run(f8, x, g, torch.bfloat16)
            dbs = [model_sqnr.sqnr(e, a) for e, a in zip(expected, got)]
            bad = any(db < t for db, t in zip(dbs, THRESHOLDS))
            failures += bad
            print(f"{scaling:14} {name:20} {dbs[0]:8.1f} {dbs[1]:10.1f} {dbs[2]:10.1f}{'  FAIL' if bad else ''}",
                  flush=True)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"torch {torch.__version__}: {'all within thresholds' if not failures else f'{failures} failing'}")
    return 1 if failures else 0


def check_model_gemms(opts: argparse.Namespace, device: torch.device) -> int:
    table = model_sqnr.sqnr_table(opts)
    missed = model_sqnr.print_table(table, opts.recipes)
    if opts.out:
        Path(opts.out).write_text(json.dumps({"args": vars(opts), "sqnr_db": table, "missed": missed}, indent=1))
    margin = f"tensorwise + {model_sqnr.MARGIN_DB:g} dB"
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}: "
          + (f"blockwise below {margin} in {len(missed)}: {'; '.join(missed)}" if missed
             else f"blockwise >= {margin} in every backward GEMM"))
    return 1 if missed else 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
