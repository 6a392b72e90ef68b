"""Benchmark float8 training linears against bf16 on one GPU, ours and the reference library's.

Times forward + backward of
  (a) each LLaMA-2-7B linear shape at M = 8192 tokens, and
  (b) a stack of 4 LLaMA-2-7B transformer blocks (batch 2 x seq 4096),
for bf16 and every float8 scaling, eager and compiled (each block compiled
with fullgraph=True, as the trainer does), with this repository's float8 package
(--impl ours), torchao's (--impl torchao) or both side by side. Prints a table last and
writes JSON (--out); an earlier file there moves to previous-N/ beside it first.

    python scripts/bench_float8.py --out bench_float8.json          # ~5 min on an H200
    python scripts/bench_float8.py --only blocks --impl both        # ours vs torchao, same run
    python scripts/bench_float8.py --quick --only blocks --profile
    python scripts/bench_float8.py --smoke                           # CPU, tiny shapes: does it run?
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from models.llama import LLAMA2_FLAVORS, TransformerBlock
from models.llama.model import precompute_rope
from scripts.harness.arguments import comma_names
from scripts.harness.float8_bench.impls import IMPLS, ReferenceMissing, convert, torchao_version
from scripts.harness.float8_bench.report import add_speedups, print_report
from scripts.harness.float8_bench.timing import Timer
from scripts.harness.traces import CLASSES, load_trace
from scripts.harness.traces import summarize as summarize_trace
from trainer.cli import ArgParser
from trainer.run_folder import keep_earlier_results

MODES = ("bf16", "tensorwise", "rowwise", "rowwise_gw_hp")
VARIANTS = ("eager", "compiled")
# LLaMA-2-7B linears as (in_features, out_features): wq/wk/wv/wo, w1/w3, w2, output.
LINEAR_SHAPES_7B = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 32000)]


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def bench_linear(in_f: int, out_f: int, tokens: int, mode: str, impl: str, variant: str, device, timer,
                 warmup, iters) -> dict:
    torch.manual_seed(0)
    holder = nn.Sequential(nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.bfloat16))
    if mode != "bf16":
        convert(holder, mode, impl)
    forward = holder
    if variant == "compiled":
        # A function of ours (dynamo skips torch's own nn.Linear frames); static shapes so
        # every linear shape gets its own specialised kernels.
        forward = torch.compile(lambda t: holder(t), fullgraph=True, dynamic=False)
    x = torch.randn(tokens, in_f, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_f, device=device, dtype=torch.bfloat16)

    def before():
        holder.zero_grad(set_to_none=True)
        x.grad = None

    def step():
        forward(x).backward(grad)

    reset_memory(device)
    times = timer.time(step, before, warmup, iters)
    ms = statistics.median(times)
    return {
        "section": "linears", "name": f"{in_f}->{out_f} M={tokens}", "mode": mode, "impl": impl, "variant": variant,
        "ms": ms, "tflops": 6 * tokens * in_f * out_f / (ms * 1e-3) / 1e12, "tokens_per_s": tokens / (ms * 1e-3),
        "peak_gib": peak_gib(device),
    }


def build_blocks(args, n_blocks: int, mode: str, impl: str, variant: str, device) -> nn.ModuleList:
    torch.manual_seed(0)
    with torch.device("meta"):
        blocks = nn.ModuleList(TransformerBlock(i, args) for i in range(n_blocks))
    if mode != "bf16":
        convert(blocks, mode, impl)
    blocks.to_empty(device=device)
    blocks.to(torch.bfloat16)
    with torch.no_grad():
        for block in blocks:
            block.init_weights()
    if variant == "compiled":
        for block in blocks:
            block.compile(fullgraph=True, dynamic=False)
    return blocks


def block_flops(args, n_blocks: int, batch: int, seq: int) -> float:
    """Training FLOPs per step as the trainer counts them (docs/outputs.md, "FLOPs per token"): 6 * params * tokens + 12 * L * dim * seq * tokens."""
    with torch.device("meta"):
        params = sum(p.numel() for p in TransformerBlock(0, args).parameters()) * n_blocks
    tokens = batch * seq
    return 6 * params * tokens + 12 * n_blocks * args.dim * seq * tokens


def bench_blocks(args, n_blocks, batch, seq, mode, impl, variant, device, timer, warmup, iters, profile) -> dict:
    blocks = build_blocks(args, n_blocks, mode, impl, variant, device)
    rope = precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta)[:seq].to(device)
    x = torch.randn(batch, seq, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def before():
        blocks.zero_grad(set_to_none=True)
        x.grad = None

    def step():
        h = x
        for block in blocks:
            h = block(h, rope, None)
        h.backward(grad)

    reset_memory(device)
    times = timer.time(step, before, warmup, iters)
    ms = statistics.median(times)
    row = {
        "section": "blocks", "name": f"{n_blocks} blocks dim={args.dim} b={batch} s={seq}",
        "mode": mode, "impl": impl, "variant": variant, "ms": ms,
        "tflops": block_flops(args, n_blocks, batch, seq) / (ms * 1e-3) / 1e12,
        "tokens_per_s": batch * seq / (ms * 1e-3), "peak_gib": peak_gib(device),
    }
    if profile and variant == "compiled":
        before()
        row["profile"] = profile_step(step, device)
    return row


def profile_step(step: Callable[[], None], device) -> dict[str, float]:
    """Device time (ms) of one step by kernel class, as scripts/harness/traces.py reads a trace
    (on a CPU, the self time of CPU ops)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        summary = summarize_trace(load_trace(trace), top=0)
    return {CLASSES[k]: c["ms"] for k, c in summary["classes"].items() if c["count"]}


def main(argv: list[str] | None = None) -> None:
    parser = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("linears", "blocks"), help="run one section")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="eager,compiled or one of them")
    parser.add_argument("--impl", choices=(*IMPLS, "both"), default="ours",
                        help="float8 implementation: this repository's, torchao's (pip install -e '.[reference]') "
                             "or both in one run (default ours)")
    parser.add_argument("--quick", action="store_true", help="fewer timed iterations")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (checks the script runs)")
    parser.add_argument("--profile", action="store_true", help="per-class kernel times of one compiled-block step")
    parser.add_argument("--out", default="bench_float8.json", help="JSON results file")
    opts = parser.parse_args(argv)
    modes = comma_names(opts.modes, MODES, "--modes")
    variants = comma_names(opts.variants, VARIANTS, "--variants")
    impls = list(IMPLS) if opts.impl == "both" else [opts.impl]
    versions = {"torch": torch.__version__}
    if "torchao" in impls:
        try:
            versions["torchao"] = torchao_version()
        except ReferenceMissing as e:
            parser.error(str(e))

    if opts.smoke:
        device = torch.device("cpu")
        args = dataclasses.replace(LLAMA2_FLAVORS["debug"], dim=64, n_heads=4, n_kv_heads=4, max_seq_len=64)
        shapes, tokens, n_blocks, batch, seq = [(64, 64), (64, 176), (176, 64)], 64, 2, 2, 32
        warmup, iters = 1, 2
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU with float8 GEMMs (H100/H200); use --smoke to test on CPU")
        device = torch.device("cuda")
        args = LLAMA2_FLAVORS["7B"]
        shapes, tokens, n_blocks, batch, seq = LINEAR_SHAPES_7B, 8192, 4, 2, 4096
        warmup, iters = (2, 5) if opts.quick else (3, 10)
    timer = Timer(device)
    out = Path(opts.out)
    keep_earlier_results(out.parent, [out.name])

    rows: list[dict] = []
    failures: list[str] = []
    sections = [opts.only] if opts.only else ["linears", "blocks"]
    runs = [(v, m, impl) for v in variants for m in modes for impl in (["-"] if m == "bf16" else impls)]
    for variant, mode, impl in runs:
        torch._dynamo.reset()
        cells: list[tuple[str, Callable[[], dict]]] = []
        if "linears" in sections:
            cells += [
                (f"{i}->{o} M={tokens}", functools.partial(
                    bench_linear, i, o, tokens, mode, impl, variant, device, timer, warmup + 2, iters * 2))
                for i, o in shapes
            ]
        if "blocks" in sections:
            cells.append((f"{n_blocks} blocks", functools.partial(
                bench_blocks, args, n_blocks, batch, seq, mode, impl, variant, device, timer, warmup, iters,
                opts.profile)))
        for name, cell in cells:
            try:
                rows.append(cell())
            except Exception as e:  # one failing cell must not lose the others' numbers
                failures.append(f"{name} {mode} {impl} {variant}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                print(f"  FAILED {failures[-1]}", flush=True)
                continue
            print(f"  {rows[-1]['name']:24} {mode:14} {impl:8} {variant:9} {rows[-1]['ms']:8.2f} ms", flush=True)

    add_speedups(rows)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        **versions,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "command": " ".join(sys.argv),
        "impls": impls,
        "results": rows,
        "failures": failures,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {opts.out} ({result['device']}, " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")")
    print_report(rows, failures)


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
