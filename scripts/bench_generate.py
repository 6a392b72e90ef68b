"""Generation speed: recomputing the whole sequence per token vs the KV cache, eager and compiled.

    python scripts/bench_generate.py                                  # debug model, CPU, 256 new tokens
    python scripts/bench_generate.py --flavor 7B --device cuda --dtype bfloat16 --batch_sizes 1,8

Untrained weights (speed does not depend on them) and no EOS, so every row generates exactly
--new_tokens tokens after a --prompt_len-token prompt. Each mode runs once untimed first (the
compiled step compiles then), then --repeats timed runs; the best is reported as new tokens
per second over all rows. Prints a markdown table, the torch version and the CPU capability.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.llama import LLAMA2_FLAVORS, Transformer  # noqa: E402
from models.llama.generation import generate, generate_without_cache  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _timed(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debug", choices=sorted(LLAMA2_FLAVORS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--batch_sizes", default="1,8", help="comma-separated")
    parser.add_argument("--prompt_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="recompute,cache,cache+compile", help="comma-separated")
    opts = parser.parse_args(argv)
    modes = opts.modes.split(",")
    unknown = set(modes) - {"recompute", "cache", "cache+compile"}
    if unknown:
        print(f"error: unknown --modes {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2

    device = torch.device(opts.device)
    args = LLAMA2_FLAVORS[opts.flavor]
    args = dataclasses.replace(args, max_seq_len=max(args.max_seq_len, opts.prompt_len + opts.new_tokens))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
        for p in model.parameters():
            p.data = p.data.to(_DTYPES[opts.dtype])
    model.eval()

    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}, device {device}, {opts.flavor} {opts.dtype}", flush=True)
    print(f"prompt {opts.prompt_len} tokens, {opts.new_tokens} new tokens per row, best of {opts.repeats}\n")
    print("| batch | mode | seconds | new tokens/s | vs recompute |")
    print("|--:|---|--:|--:|--:|")
    for batch in (int(b) for b in opts.batch_sizes.split(",")):
        prompts = torch.randint(3, args.vocab_size, (batch, opts.prompt_len)).tolist()
        runs = {
            "recompute": functools.partial(generate_without_cache, model, prompts, opts.new_tokens, eos_id=-1),
            "cache": functools.partial(generate, model, prompts, opts.new_tokens, eos_id=-1),
            "cache+compile": functools.partial(generate, model, prompts, opts.new_tokens, eos_id=-1, compile_decode=True),
        }
        baseline = None
        for mode in modes:
            seconds = _timed(runs[mode], opts.repeats)
            rate = batch * opts.new_tokens / seconds
            baseline = rate if mode == "recompute" else baseline
            ratio = f"{rate / baseline:.1f}x" if baseline else "-"
            print(f"| {batch} | {mode} | {seconds:.2f} | {rate:,.0f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
