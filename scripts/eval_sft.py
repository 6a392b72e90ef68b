"""Exact match of greedy answers on the held-out SFT split (``data.eval_path``).

    python scripts/eval_sft.py --config configs/debug_sft.toml
    python scripts/eval_sft.py --config configs/debug_sft.toml --job.dump_folder /tmp/run --show 5
    python scripts/eval_sft.py --config configs/debug_sft.toml --checkpoint.enable false   # the untrained model

Evaluates what the trainer would resume from: the latest checkpoint of the config's dump
folder (or ``--weights PATH``, see trainer/inference.py). Each row is rendered with the
LLaMA-2 chat template up to its final ``[/INST]``; the greedy continuation up to EOS,
stripped, must equal the reference reply. The last line printed is
``exact_match=<fraction>``.

The rows are generated ``--batch_size`` at a time, every batch of the same shape (the last
one filled with dummy rows), so on CUDA the step's CUDA graph is captured once for the whole
set (with ``--compile``, its blocks compile once, and the prefill once per prompt-width
bucket). A stderr line shows the rows done and the new tokens per second.
"""

from __future__ import annotations

import argparse
import sys
import time

from trainer.data.sft import SFTOptions, load_sft_rows, reference_answer, render_prompt
from trainer.errors import UserError
from trainer.inference import add_model_flags, generate_with, model_from_opts, parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--max_samples", type=int, default=0, help="evaluate the first N rows (0 = all)")
    parser.add_argument("--batch_size", type=int, default=64, help="prompts generated together")
    parser.add_argument("--show", type=int, default=0, help="print the first N (prompt, answer, reference)")
    add_model_flags(parser)
    try:
        opts, cfg = parse(parser, argv)
        if opts.max_samples < 0 or opts.batch_size < 1:
            raise UserError("--max_samples must be >= 0 and --batch_size >= 1")
        if not cfg.data.eval_path:
            raise UserError("data.eval_path is not set (the held-out SFT split to evaluate)")
        # The eval rows are read like the training rows, whatever data.kind says.
        options = SFTOptions.from_config(cfg.data)
        rows = load_sft_rows(cfg.data.eval_path, options, cfg.data.format)
        if opts.max_samples:
            rows = rows[: opts.max_samples]
        model, tokenizer, source = model_from_opts(opts, cfg)
        prompts = [render_prompt(r, tokenizer, options) for r in rows]
        references = [reference_answer(r, options) for r in rows]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    # Room for the longest reference, its trailing space piece and a little slack; a model
    # that never stops is wrong either way.
    max_new = opts.max_new_tokens or max(len(tokenizer.encode(r, bos=False, eos=False)) for r in references) + 4
    print(f"evaluating {len(rows)} rows of {cfg.data.eval_path} with weights: {source}", flush=True)
    start = time.perf_counter()
    outputs = generate_with(opts, model, prompts, max_new, tokenizer.eos_id, batch_size=opts.batch_size)
    answers = [tokenizer.decode(o).strip() for o in outputs]
    correct = [a == r for a, r in zip(answers, references)]
    for k in range(min(opts.show, len(rows))):
        mark = "ok " if correct[k] else "BAD"
        print(f"{mark} {tokenizer.decode(prompts[k])!r} -> {answers[k]!r} (reference {references[k]!r})")
    print(f"{sum(correct)}/{len(rows)} exact in {time.perf_counter() - start:.1f}s", flush=True)
    print(f"exact_match={sum(correct) / len(rows):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
