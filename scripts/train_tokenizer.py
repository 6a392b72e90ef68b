"""Train a small SentencePiece BPE tokenizer in LLaMA-2's format.

Same normalizer and special ids as Meta's ``tokenizer.model`` (unk 0, bos 1,
eos 2, no pad piece, byte fallback, split digits, dummy prefix, identity
normalization), so ``trainer.data.tokenizer.Tokenizer`` treats both alike.
Pretraining rows contribute their ``text``; SFT rows (alpaca or chat)
contribute their LLaMA-2 chat rendering, so ``[INST]`` and the task words
become compact pieces. Lines are sentences, so newlines fall back to bytes
as in LLaMA-2. Same inputs, same model bytes.

    python scripts/train_tokenizer.py --force  # data/corpus + data/sft -> data/tokenizer.model

An existing --out is refused unless --force (checked before training).
"""

import argparse
import io
import itertools
import sys
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from trainer.cli import ArgParser
from trainer.data.loader import BadRow, DataSource
from trainer.data.sft import SFTOptions, detect_format, parse_row, turn_strings
from trainer.errors import UserError
from trainer.run_folder import refuse_to_overwrite


def texts(path: str) -> Iterator[str]:
    source = DataSource(path)
    options = SFTOptions()
    for loc, row in source.rows():
        if isinstance(row, BadRow):
            raise UserError(f"{source.locate(loc)}: {row.problem}")
        if isinstance(row.get("text"), str):
            yield row["text"]
        else:
            for prompt, reply in turn_strings(parse_row(row, detect_format(row, options), options)):
                yield f"{prompt} {reply}"


def sentences(paths: list[str]) -> Iterator[str]:
    for path in paths:
        for text in texts(path):
            for line in text.split("\n"):
                if line.strip():
                    yield line


def train(paths: list[str], vocab_size: int) -> bytes:
    """A BPE SentencePiece model of `vocab_size` pieces; a corpus it cannot be trained on (no text, or
    too little for the vocabulary) is a one-line UserError naming sentencepiece's reason."""
    if vocab_size < 4:  # unk, bos, eos and one piece
        raise UserError(f"--vocab-size must be at least 4, got {vocab_size}")
    lines = sentences(paths)
    first = next(lines, None)
    if first is None:
        raise UserError(f"{', '.join(paths)} hold no text to train a tokenizer on (every row is empty or whitespace)")
    model = io.BytesIO()
    try:
        _train_into(model, itertools.chain([first], lines), vocab_size)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UserError(f"sentencepiece cannot train a {vocab_size}-piece tokenizer on {', '.join(paths)}: "
                        f"{reason}") from None
    return model.getvalue()


def _train_into(model: io.BytesIO, lines: Iterator[str], vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        character_coverage=0.99995,
        byte_fallback=True,
        split_digits=True,
        split_by_unicode_script=True,
        split_by_whitespace=True,
        split_by_number=True,
        allow_whitespace_only_pieces=True,
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        max_sentence_length=4192,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        # one thread and every sentence: no sampling, no thread-order effects
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="*", default=["data/corpus", "data/sft/train.jsonl", "data/sft/chat_example.jsonl"],
                   help="files or folders (JSONL, parquet, text)")
    p.add_argument("--out", default="data/tokenizer.model")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--force", action="store_true", help="overwrite an existing --out")
    try:
        args = p.parse_args(argv)
        if not args.force:
            refuse_to_overwrite([Path(args.out)])
        model = train(args.inputs, args.vocab_size)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    with open(args.out, "wb") as f:
        f.write(model)
    print(f"wrote {args.out} ({len(model)} bytes, vocab {args.vocab_size})")
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
