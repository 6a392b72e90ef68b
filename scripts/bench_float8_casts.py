"""Time the memory-bound kernels around a float8 step's GEMMs on a GPU: the eager float8 casts one
linear needs (float8/operands.py), per cast backend, and the AdamW update whose weights the float8
weight casts then read; and the host time of a cast call.

Casts: for LLaMA-2-7B shapes at 8,192 tokens, an activation or gradient cast into both layouts its
two GEMMs read (tensorwise, rowwise, and blockwise's 1x128 tiles), a weight cast with a known
scale (FSDP's float8 all-gather), and a float8 transpose; ms and effective bandwidth (bytes the
cast must move at least: one read of the input, each output written once) per backend. AdamW:
torch's fused kernel against the trainer's Triton kernel at each program size and warp count
(scripts/harness/float8_bench/adamw.py). Host: microseconds of CPU time a rowwise, 1x128-tile or
tensorwise cast call costs, through its op and straight (scripts/harness/float8_bench/host.py). Packing:
FSDP2's gradient packing before a reduce-scatter, chunk_cat against the trainer's foreach copies, at 1
and 8 ranks (scripts/harness/float8_bench/packing.py).
Prints the tables last; writes JSON (an earlier file there moves to previous-N/ beside it first).

    python scripts/bench_float8_casts.py --out bench_float8_casts.json
    python scripts/bench_float8_casts.py --only adamw,host,packing
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from float8.operands import Operand, cast_weight_with_scale, operands_both, transposed
from float8.recipe import RECIPES
from float8.scaling import E4M3, cast_with_scale
from scripts.harness.arguments import comma_names
from scripts.harness.float8_bench import adamw, host, packing
from scripts.harness.float8_bench.timing import Timer
from trainer.run_folder import keep_earlier_results

BACKENDS = ("triton", "compiled", "plain")
SECTIONS = ("casts", "adamw", "host", "packing")
TOKENS = 8192
ACTIVATIONS = [(TOKENS, 4096), (TOKENS, 11008)]
WEIGHTS = [(4096, 4096), (11008, 4096)]


def time_ms(fn: Callable[[], object]) -> float:
    """Median CUDA-event time of `fn`, 20 runs after 3 warm-up runs."""
    return statistics.median(Timer(torch.device("cuda")).time(fn, lambda: None, warmup=3, iters=20))


def both_layouts(x: torch.Tensor, scaling: str, backend: str) -> Callable[[], object]:
    recipe = RECIPES[scaling]
    rows, cols = recipe.output.lhs, recipe.grad_weight.rhs

    def cast():
        _, op_t, later = operands_both(x, rows, cols, backend)
        return transposed(op_t, backend) if later else op_t

    return cast


def cells(backends: list[str]) -> list[tuple[str, str, Callable[[], object], int]]:
    """(what, backend, the cast, bytes it moves at least)."""
    out = []
    for m, k in ACTIVATIONS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for scaling in ("tensorwise", "rowwise", "blockwise"):
            out += [(f"{scaling} both layouts bf16 {m}x{k}", b, both_layouts(x, scaling, b), 4 * m * k) for b in backends]
    for n, k in WEIGHTS:
        w = torch.randn(n, k, device="cuda")
        scale = torch.tensor(448.0, device="cuda") / w.abs().max()
        out.append((f"weight cast fp32 {n}x{k}", "triton", lambda w=w, s=scale: cast_weight_with_scale(w, s, E4M3), 5 * n * k))
        out.append((f"weight cast fp32 {n}x{k}", "plain", lambda w=w, s=scale: cast_with_scale(w, s, E4M3), 5 * n * k))
        data = w.to(E4M3)
        out += [(f"float8 transpose {n}x{k}", b, lambda d=data, b=b: transposed(Operand(d, torch.ones((), device="cuda")), b), 2 * n * k)
                for b in ("triton", "plain")]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench_float8_casts.json")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma list of %(default)s (default all)")
    opts = parser.parse_args(argv)
    only = comma_names(opts.only, SECTIONS, "--only")
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    out = Path(opts.out)
    keep_earlier_results(out.parent, [out.name])
    rows = []
    for what, backend, fn, nbytes in cells(list(BACKENDS)) if "casts" in only else ():
        ms = time_ms(fn)
        rows.append({"cast": what, "backend": backend, "ms": ms, "gb_per_s": nbytes / ms / 1e6})
        print(f"  {what:40} {backend:9} {ms:8.3f} ms {rows[-1]['gb_per_s']:7.0f} GB/s", flush=True)
    updates, n_params = [], 0
    if "adamw" in only:
        kernels, weights = adamw.kernels(torch.device("cuda"))
        n_params = sum(w.numel() for w in weights)
        updates = [{"kernel": name, "ms": (ms := time_ms(fn)), "tb_per_s": adamw.BYTES_PER_PARAM * n_params / ms / 1e9}
                   for name, fn in kernels]
        del kernels, weights
    host_calls = [{"call": name, "us": host.host_us(fn)} for name, fn in host.calls(torch.device("cuda"))] if "host" in only else []
    packings, n_packed = [], 0
    if "packing" in only:
        packing_cells, n_packed = packing.kernels(torch.device("cuda"))
        packings = [{"packing": name, "ranks": ranks, "ms": (ms := time_ms(fn)), "host_us": host.host_us(fn, packing.HOST_CALLS, warmup=3),
                     "tb_per_s": packing.BYTES_PER_PARAM * n_packed / ms / 1e9} for name, ranks, fn, _ in packing_cells]
        del packing_cells
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "results": rows,
              "adamw": {"params": n_params, "results": updates},
              "host": {"shape": list(host.SHAPE), "results": host_calls},
              "packing": {"params": n_packed, "results": packings}}
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {opts.out} ({result['device']}, torch {torch.__version__})")
    if rows:
        print(f"{'cast':40} " + " ".join(f"{b:>16}" for b in BACKENDS))
    for what in dict.fromkeys(r["cast"] for r in rows):
        by = {r["backend"]: r for r in rows if r["cast"] == what}
        print(f"{what:40} " + " ".join(
            f"{by[b]['ms']:7.3f} {by[b]['gb_per_s']:5.0f}GB/s" if b in by else f"{'-':>16}" for b in BACKENDS))
    if updates:
        print(f"\nAdamW over {n_params / 1e6:,.0f} M fp32 parameters")
    for r in updates:
        print(f"{r['kernel']:40} {r['ms']:7.3f} ms {r['tb_per_s']:5.2f} TB/s")
    if host_calls:
        print(f"\nHost time a cast call, {host.SHAPE[0]} x {host.SHAPE[1]} bf16")
    for r in host_calls:
        print(f"{r['call']:48} {r['us']:7.1f} us")
    if packings:
        print(f"\nGradient packing of one 7B block ({n_packed / 1e6:,.0f} M bf16 gradients into fp32)")
    for r in packings:
        print(f"{r['packing']:9} at {r['ranks']} ranks  device {r['ms']:6.3f} ms {r['tb_per_s']:5.2f} TB/s  host {r['host_us']:7.1f} us")


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
