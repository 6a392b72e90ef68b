"""Generate from a trained LLaMA-2: greedy or top-p sampling, LLaMA-2 chat template by default.

    python scripts/generate.py --config configs/debug_sft.toml --prompt "Which digit is the largest?

    3 8 1"
    python scripts/generate.py --config configs/debug_sft.toml --prompt "Copy the words: cat dog" \\
        --temperature 0.8 --top_p 0.9 --num_samples 3
    python scripts/generate.py --config configs/debug.toml --raw --prompt "Anna has a"
    python scripts/generate.py --config configs/debug_sft.toml \\
        --weights outputs/debug_sft/checkpoints/final/model.safetensors --prompt "..."

Weights, first that applies: ``--weights`` (a DCP checkpoint folder ``step-N``, a
``model.safetensors`` or its export folder, a Hugging Face or Meta folder); the latest
checkpoint under the config's dump folder (when ``checkpoint.enable``); the config's
``checkpoint.initial_load_path``; else the untrained initialisation, with a warning.
Any ``--section.key value`` overrides the config as in train.py.

One process, no float8: DCP checkpoints (also of sharded or float8 runs, whose linears
keep ordinary weights) load into a plain model; it runs in fp32 on CPU, bf16 on GPU.
Decoding uses a static KV cache (models/llama/generation.py): the prompts are prefilled in
one forward, then each step runs one token per row, on CUDA replayed as a CUDA graph (captured
in about a second). ``--compile`` also compiles the blocks: faster steps, but the first call
compiles for 10-25 s at 7B (docs/benchmarks.md), so it pays for long generations only.
``--eager`` neither captures nor compiles, and ``--no_kv_cache`` runs the whole sequence for
every token instead (the slow reference). A line on stderr reports the new tokens per second.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from trainer.errors import UserError
from trainer.inference import (
    add_model_flags,
    chat_prompt,
    check_prompt_lengths,
    generate_with,
    model_from_opts,
    parse,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--prompt", action="append", required=True, help="a user message (repeat for a batch)")
    parser.add_argument("--system", help="system prompt (chat template only)")
    parser.add_argument("--raw", action="store_true", help="plain text continuation, no chat template")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (with temperature > 0)")
    parser.add_argument("--num_samples", type=int, default=1, help="completions per prompt")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_model_flags(parser)
    try:
        opts, cfg = parse(parser, argv)
        # `not`: NaN fails every comparison, so it is refused too.
        if not (0 < opts.top_p <= 1 and 0 <= opts.temperature < math.inf and opts.num_samples >= 1):
            raise UserError(f"need 0 < --top_p <= 1, a finite --temperature >= 0 and --num_samples >= 1 (got "
                            f"--top_p {opts.top_p}, --temperature {opts.temperature}, --num_samples {opts.num_samples})")
        model, tokenizer, source = model_from_opts(opts, cfg)
        print(f"weights: {source}", file=sys.stderr, flush=True)
        if opts.raw:
            prompts = [tokenizer.encode(p, bos=True, eos=False) for p in opts.prompt]
        else:
            prompts = [chat_prompt(tokenizer, p, opts.system) for p in opts.prompt]
        check_prompt_lengths(prompts, model.model_args.max_seq_len)
        prompts = [p for p in prompts for _ in range(opts.num_samples)]
        generator = torch.Generator().manual_seed(opts.seed)
        outputs = generate_with(
            opts, model, prompts, opts.max_new_tokens or 128, tokenizer.eos_id, opts.temperature, opts.top_p,
            generator,
        )
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    texts = [tokenizer.decode(o) for o in outputs]
    for k, text in enumerate(texts):
        prompt = opts.prompt[k // opts.num_samples]
        print(f"### {prompt}\n{text}" if opts.raw else f"### [INST] {prompt} [/INST]\n{text.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
