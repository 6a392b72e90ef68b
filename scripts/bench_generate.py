"""Generation speed: recomputing the whole sequence per token vs the KV cache, eager, as a
CUDA graph and compiled.

    python scripts/bench_generate.py                                  # debug model, CPU, 256 new tokens
    python scripts/bench_generate.py --flavor 7B --device cuda --dtype bfloat16 --batch_sizes 1,8 \\
        --prompt_len 32 --new_tokens 128 --json /tmp/gen.json

Modes: ``recompute`` (the whole sequence per token, the reference), ``cache`` (static KV
cache, eager, one host loop iteration per token), ``cache+graph`` (the same step captured
as a CUDA graph, CUDA only), ``cache+compile`` (compiled blocks, replayed as a CUDA graph on
CUDA). Untrained weights (speed does not depend on them), built on the target device, and
no EOS, so every row generates exactly --new_tokens tokens after a --prompt_len-token
prompt. Each mode runs once first, timed as "first call" (compilation and graph capture
included), then --repeats timed runs; the best is reported as new tokens per second over
all rows. Prints a markdown table, the torch version and the device; --json writes the
same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch

from models.llama import LLAMA2_FLAVORS, Transformer
from models.llama.generation import generate, generate_without_cache
from trainer.precision import TORCH_DTYPES

MODES = ("recompute", "cache", "cache+graph", "cache+compile")


def _seconds(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def build_model(flavor: str, max_seq_len: int, device: torch.device, dtype: torch.dtype) -> Transformer:
    """An untrained model, materialised on ``device`` (a 7B model never goes through the CPU)."""
    args = LLAMA2_FLAVORS[flavor]
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, max_seq_len))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
        # One parameter at a time: the float32 copy of a 7B model is never held next to the bf16 one.
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debug", choices=sorted(LLAMA2_FLAVORS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch_sizes", default="1,8", help="comma-separated")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", help=f"comma-separated of {', '.join(MODES)} (default: all that run on the device)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    default_modes = MODES if device.type == "cuda" else tuple(m for m in MODES if m != "cache+graph")
    modes = opts.modes.split(",") if opts.modes else list(default_modes)
    unknown = set(modes) - set(MODES)
    if unknown or ("cache+graph" in modes and device.type != "cuda"):
        print(f"error: --modes must be of {', '.join(default_modes)} on {device.type}", file=sys.stderr)
        return 2
    try:
        batch_sizes = [int(b) for b in opts.batch_sizes.split(",")]
    except ValueError:
        batch_sizes = []
    if not batch_sizes or min(batch_sizes) < 1 or opts.prompt_len < 1 or opts.new_tokens < 1 or opts.repeats < 1:
        print("error: need --batch_sizes like 1,8 and positive --prompt_len, --new_tokens, --repeats",
              file=sys.stderr)
        return 2
    dtype_name = opts.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model = build_model(opts.flavor, opts.prompt_len + opts.new_tokens, device, TORCH_DTYPES[dtype_name])

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {torch.backends.cpu.get_cpu_capability()}"
    print(f"torch {torch.__version__}, {where}, threads {torch.get_num_threads()}, {opts.flavor} {dtype_name}", flush=True)
    print(f"prompt {opts.prompt_len} tokens, {opts.new_tokens} new tokens per row, best of {opts.repeats} "
          "after a first call (compilation and capture included)\n", flush=True)
    cuda = device.type == "cuda"
    results = []
    for batch in batch_sizes:
        prompts = torch.randint(3, model.model_args.vocab_size, (batch, opts.prompt_len)).tolist()
        cached = functools.partial(generate, model, prompts, opts.new_tokens, eos_id=-1, batch_size=batch)
        runs = {
            "recompute": functools.partial(generate_without_cache, model, prompts, opts.new_tokens, eos_id=-1),
            "cache": cached,
            "cache+graph": functools.partial(cached, cuda_graph=True),
            "cache+compile": functools.partial(cached, compile_decode=True, cuda_graph=cuda),
        }
        for mode in modes:
            first = _seconds(runs[mode], device)
            seconds = min(_seconds(runs[mode], device) for _ in range(opts.repeats))
            results.append({"batch": batch, "mode": mode, "first_call_s": round(first, 3), "seconds": round(seconds, 4),
                            "tokens_per_s": round(batch * opts.new_tokens / seconds, 1)})
            print(f"  batch {batch} {mode}: {results[-1]['tokens_per_s']:,.0f} tokens/s, first call {first:.1f}s",
                  file=sys.stderr, flush=True)

    print("| batch | mode | first call s | seconds | new tokens/s | vs recompute |")
    print("|--:|---|--:|--:|--:|--:|")
    for r in results:
        base = next((b["tokens_per_s"] for b in results if b["batch"] == r["batch"] and b["mode"] == "recompute"), None)
        ratio = f"{r['tokens_per_s'] / base:.1f}x" if base else "-"
        print(f"| {r['batch']} | {r['mode']} | {r['first_call_s']:.1f} | {r['seconds']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {ratio} |", flush=True)
    if opts.json:
        facts = {"torch": torch.__version__, "device": where, "flavor": opts.flavor, "dtype": dtype_name,
                 "prompt_len": opts.prompt_len, "new_tokens": opts.new_tokens, "repeats": opts.repeats}
        Path(opts.json).write_text(json.dumps({**facts, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
