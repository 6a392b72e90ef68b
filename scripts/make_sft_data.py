"""Generate the shipped synthetic instruction data (alpaca and chat format).

Four short, deterministic tasks that a tiny LLaMA (dim 256, 4 layers, vocab 2048)
learns on a 2-core CPU in minutes: sort 3-5 distinct digits, name the largest of
3-5 digits, reverse 3 words, repeat 3-4 words (words from a 20-word list). The
held-out split shares no (task, input) with train. A quarter of the alpaca rows
carry the input inside the instruction, with an empty "input".

    python scripts/make_sft_data.py --force  # rewrites data/sft/{train,eval,chat_example}.jsonl

An --out that holds any of the three files is refused unless --force.
"""

import argparse
import json
import random
import sys
from pathlib import Path

from trainer.cli import ArgParser
from trainer.errors import UserError
from trainer.run_folder import refuse_to_overwrite

WORDS = [
    "cat", "dog", "cow", "duck", "owl", "fox", "bear", "bee", "pig", "hen",
    "red", "blue", "ball", "book", "key", "box", "hat", "cup", "lamp", "map",
]
TASKS = {
    "sort": ["Sort the digits in ascending order.", "Put these digits in order from smallest to largest."],
    "max": ["Which digit is the largest?", "Name the largest digit."],
    "reverse": ["Reverse the order of the words.", "Write the words in reverse order."],
    "repeat": ["Repeat the words exactly.", "Copy the words."],
}
# "max" is learned first; the harder tasks get more of the rows
WEIGHTS = {"sort": 3, "max": 1.5, "reverse": 3, "repeat": 2.5}
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer with the result only."]
FILES = ("train.jsonl", "eval.jsonl", "chat_example.jsonl")


def make_input(rng: random.Random, task: str) -> tuple[str, ...]:
    # Items are distinct (except for "max"): with repeats, "find the item I just
    # wrote and take its neighbour" is ambiguous and a tiny model learns far slower.
    if task == "max":
        return tuple(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 5)))
    if task == "sort":
        return tuple(str(d) for d in rng.sample(range(10), rng.randint(3, 5)))
    return tuple(rng.sample(WORDS, 3 if task == "reverse" else rng.randint(3, 4)))


def solve(task: str, items: tuple[str, ...]) -> str:
    if task == "sort":
        return " ".join(sorted(items))
    if task == "max":
        return max(items)
    if task == "reverse":
        return " ".join(reversed(items))
    return " ".join(items)


def alpaca_row(rng: random.Random, task: str, items: tuple[str, ...]) -> dict[str, str]:
    instruction = rng.choice(TASKS[task])
    text = " ".join(items)
    # a quarter of the rows carry the input inside the instruction (empty "input")
    if rng.random() < 0.25:
        return {"instruction": f"{instruction[:-1]}: {text}", "input": "", "output": solve(task, items)}
    return {"instruction": instruction, "input": text, "output": solve(task, items)}


def make_splits(n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[tuple[str, tuple[str, ...]]] = set()
    splits: list[list[dict]] = [[], []]
    for split, n in ((1, n_eval), (0, n_train)):
        while len(splits[split]) < n:
            task = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
            items = make_input(rng, task)
            if (task, items) in seen:
                continue
            seen.add((task, items))
            splits[split].append(alpaca_row(rng, task, items))
    return splits[0], splits[1]


def chat_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.randint(1, 3)):
            task = rng.choice(list(TASKS))
            items = make_input(rng, task)
            messages.append({"role": "user", "content": f"{rng.choice(TASKS[task])}\n\n{' '.join(items)}"})
            messages.append({"role": "assistant", "content": solve(task, items)})
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {path} ({len(rows)} rows)")


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/sft", help="output folder")
    p.add_argument("--train", type=int, default=10000, help="train rows")
    p.add_argument("--eval", type=int, default=400, help="held-out rows")
    p.add_argument("--chat", type=int, default=40, help="chat-format example rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help=f"overwrite {', '.join(FILES)} in --out")
    try:
        args = p.parse_args(argv)
        out = Path(args.out)
        if not args.force:
            refuse_to_overwrite(out / name for name in FILES)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_splits(args.train, args.eval, args.seed)
    for name, rows in zip(FILES, (train, held_out, chat_rows(args.chat, args.seed + 1)), strict=True):
        write_jsonl(out / name, rows)
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
