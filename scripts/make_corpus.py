"""Generate the shipped pretraining corpus: deterministic, English-like, no downloads.

A tiny world (people, animals, places, things) with fixed facts is described by
templated stories, fact sheets, dialogues, arithmetic and counting. The text is
regular enough that a tiny LLaMA's loss falls clearly within 100 steps, and
varied enough (a few hundred words) to be a useful tokenizer corpus.

    python scripts/make_corpus.py --force         # rewrites the shipped data/corpus/*.jsonl
    python scripts/make_corpus.py --out /tmp/c --docs 100
    python scripts/make_corpus.py --out data/heldout --docs 200 --shards 1 --seed 1 --name valid --force

An --out that holds <name>-*.jsonl shards is refused unless --force, which replaces all of
them: a stale shard left beside the new ones would be trained on.

A code corpus the model cannot memorize, from files on this machine (one document per file,
whole files held out by a hash of their path below the glob's root; see scripts/corpus/from_files.py):

    python scripts/make_corpus.py --from-files "$(python -c 'import sysconfig;print(sysconfig.get_paths()["stdlib"])')/**/*.py" --out data/code --heldout-out data/code_heldout
"""

import argparse
import random
import re
import sys
from pathlib import Path

from scripts.corpus import from_files
from trainer.cli import ArgParser
from trainer.errors import UserError
from trainer.run_folder import check_writable, refuse_to_overwrite

NAMES = [
    "Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Ivy", "Jack",
    "Kate", "Leo", "Mia", "Noah", "Olivia", "Peter", "Rose", "Sam", "Tom", "Uma",
    "Victor", "Wendy", "Lily", "Max", "Nora", "Oscar", "Ruby", "Lucy", "Hugo", "Zoe",
]
PRONOUN = {n: ("she" if n in {
    "Anna", "Clara", "Emma", "Grace", "Ivy", "Kate", "Mia", "Olivia", "Rose", "Uma",
    "Wendy", "Lily", "Nora", "Ruby", "Lucy", "Zoe",
} else "he") for n in NAMES}

# animal: (legs, sound, home, food, color)
ANIMALS = {
    "cat": (4, "meow", "house", "fish", "grey"),
    "dog": (4, "woof", "house", "bones", "brown"),
    "cow": (4, "moo", "farm", "grass", "white"),
    "duck": (2, "quack", "pond", "bread", "yellow"),
    "frog": (4, "ribbit", "pond", "flies", "green"),
    "owl": (2, "hoot", "forest", "mice", "brown"),
    "horse": (4, "neigh", "farm", "hay", "black"),
    "sheep": (4, "baa", "farm", "grass", "white"),
    "bee": (6, "buzz", "garden", "nectar", "yellow"),
    "lion": (4, "roar", "savanna", "meat", "golden"),
    "mouse": (4, "squeak", "barn", "cheese", "grey"),
    "pig": (4, "oink", "farm", "apples", "pink"),
    "fox": (4, "yip", "forest", "berries", "red"),
    "bear": (4, "growl", "forest", "honey", "brown"),
    "hen": (2, "cluck", "farm", "corn", "red"),
    "goat": (4, "bleat", "hill", "leaves", "white"),
    "spider": (8, "nothing", "garden", "flies", "black"),
    "rabbit": (4, "nothing", "meadow", "carrots", "white"),
    "crow": (2, "caw", "field", "seeds", "black"),
    "snake": (0, "hiss", "desert", "eggs", "green"),
}
PLACES = [
    "the village", "the city", "the forest", "the farm", "the beach", "the park",
    "the mountains", "the valley", "the old town", "the little island", "the garden",
    "the school", "the market", "the library", "the river bank", "the meadow",
]
THINGS = [
    "ball", "book", "key", "box", "hat", "cup", "kite", "lamp", "map", "shell",
    "stone", "coin", "bell", "boat", "drum", "flower", "apple", "letter", "ring", "spoon",
    "basket", "candle", "clock", "feather", "ladder", "mirror", "pencil", "rope", "scarf", "wheel",
]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "pink", "brown"]
ADJS = [
    "small", "big", "happy", "sad", "clever", "brave", "shy", "kind", "quiet", "funny",
    "old", "young", "tired", "curious", "busy", "gentle", "proud", "lazy", "friendly", "careful",
]
FEELINGS = ["happy", "sad", "surprised", "tired", "excited", "proud", "scared", "calm"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "cloudy", "snowy", "foggy"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
]
# verb: past tense, object phrase
ACTIONS = [
    ("play", "played", "with a {color} {thing}"),
    ("read", "read", "a book about the {animal}"),
    ("walk", "walked", "to {place}"),
    ("look", "looked", "for a lost {thing}"),
    ("paint", "painted", "a {color} {thing}"),
    ("build", "built", "a {adj} house for the {animal}"),
    ("sing", "sang", "a song about {place}"),
    ("carry", "carried", "a {thing} to {place}"),
    ("find", "found", "a {color} {thing} near {place}"),
    ("help", "helped", "the {animal} find its {thing}"),
    ("draw", "drew", "a picture of a {animal}"),
    ("clean", "cleaned", "the {thing}"),
]
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
]


def plural(word: str) -> str:
    irregular = {"mouse": "mice", "sheep": "sheep"}
    if word in irregular:
        return irregular[word]
    return word + ("es" if word.endswith(("s", "x", "ch", "sh")) else "s")


def _fill(rng: random.Random, template: str) -> str:
    return template.format(
        color=rng.choice(COLORS), thing=rng.choice(THINGS), animal=rng.choice(list(ANIMALS)),
        place=rng.choice(PLACES), adj=rng.choice(ADJS),
    )


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    he = PRONOUN[name]
    animal = rng.choice(list(ANIMALS))
    place = rng.choice(PLACES)
    thing, color = rng.choice(THINGS), rng.choice(COLORS)
    s = [
        f"Once upon a time, there was a {rng.choice(ADJS)} {animal} named {name}.",
        f"{name} lived in {place} with a friend called {friend}.",
        f"It was a {rng.choice(WEATHER)} day in {rng.choice(MONTHS)}.",
    ]
    for _ in range(rng.randint(2, 5)):
        _, past, obj = rng.choice(ACTIONS)
        who = rng.choice([name, friend, he.capitalize()])
        s.append(f"{who} {past} {_fill(rng, obj)}.")
    s.append(f"Then {name} found a {color} {thing} under a tree.")
    s.append(f'"Look, {friend}! A {color} {thing}!" said {name}.')
    s.append(f'"What a {rng.choice(ADJS)} {thing}," said {friend}.')
    s.append(f"They took the {thing} home and felt {rng.choice(FEELINGS)}.")
    s.append(rng.choice(["The end.", f"And {name} kept the {thing} forever.", "They slept well that night."]))
    return " ".join(s)


def fact_sheet(rng: random.Random) -> str:
    animals = rng.sample(list(ANIMALS), rng.randint(2, 4))
    s = []
    for a in animals:
        legs, sound, home, food, color = ANIMALS[a]
        s.append(f"The {a} is an animal. A {a} has {legs} legs.")
        s.append(f"The {a} lives in the {home} and eats {food}.")
        s.append(f"Most {plural(a)} are {color}.")
        s.append(f"The {a} says {sound}." if sound != "nothing" else f"The {a} does not make a sound.")
    return " ".join(s)


def qa(rng: random.Random) -> str:
    s = []
    for _ in range(rng.randint(3, 6)):
        a = rng.choice(list(ANIMALS))
        legs, sound, home, food, _ = ANIMALS[a]
        q, ans = rng.choice([
            (f"How many legs does a {a} have?", f"A {a} has {legs} legs."),
            (f"Where does the {a} live?", f"The {a} lives in the {home}."),
            (f"What does the {a} eat?", f"The {a} eats {food}."),
            (f"What does the {a} say?", f"The {a} says {sound}."),
        ])
        s.append(f"Question: {q} Answer: {ans}")
    return "\n".join(s)


def dialogue(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    thing, place = rng.choice(THINGS), rng.choice(PLACES)
    day = rng.choice(DAYS)
    lines = [
        f'{a} asked {b}, "Where is my {thing}?"',
        f'{b} said, "I saw your {thing} in {place} on {day}."',
        f'"Thank you, {b}," said {a}. "I will go to {place} now."',
    ]
    if rng.random() < 0.5:
        n = rng.randint(2, 9)
        lines.append(f'"Can you bring {NUMBER_WORDS[n]} {plural(rng.choice(THINGS))} too?" asked {b}.')
        lines.append(f'"Yes, I can bring {n}," said {a}.')
    return "\n".join(lines)


def arithmetic(rng: random.Random) -> str:
    s = []
    for _ in range(rng.randint(4, 10)):
        x, y = rng.randint(0, 50), rng.randint(0, 50)
        op = rng.choice(["plus", "minus", "times"])
        if op == "plus":
            s.append(f"{x} plus {y} equals {x + y}.")
        elif op == "minus":
            x, y = max(x, y), min(x, y)
            s.append(f"{x} minus {y} equals {x - y}.")
        else:
            x, y = x % 13, y % 13
            s.append(f"{x} times {y} equals {x * y}.")
    return " ".join(s)


def counting(rng: random.Random) -> str:
    kind = rng.randint(0, 3)
    if kind == 0:
        start = rng.randint(1, 80)
        n = rng.randint(5, 15)
        return f"Let us count from {start} to {start + n - 1}: " + ", ".join(
            str(i) for i in range(start, start + n)) + "."
    if kind == 1:
        i = rng.randrange(7)
        return (f"The days of the week are {', '.join(DAYS)}. "
                f"After {DAYS[i]} comes {DAYS[(i + 1) % 7]}. Before {DAYS[i]} comes {DAYS[i - 1]}.")
    if kind == 2:
        i = rng.randrange(12)
        return (f"The months of the year are {', '.join(MONTHS)}. "
                f"After {MONTHS[i]} comes {MONTHS[(i + 1) % 12]}.")
    n = rng.randint(1, 12)
    return (f"The number {n} is written as {NUMBER_WORDS[n]}. "
            f"{NUMBER_WORDS[n].capitalize()} and one make {NUMBER_WORDS[n + 1] if n < 12 else 'thirteen'}.")


def shopping(rng: random.Random) -> str:
    name = rng.choice(NAMES)
    items = rng.sample(THINGS, rng.randint(2, 4))
    prices = [rng.randint(2, 20) for _ in items]
    s = [f"{name} went to the market with {sum(prices) + rng.randint(0, 10)} coins."]
    for it, p in zip(items, prices):
        s.append(f"A {it} costs {p} coins.")
    s.append(f"{name} bought {', '.join('a ' + it for it in items)}. That is {sum(prices)} coins in total.")
    return " ".join(s)


_ARTICLE = re.compile(r"\b([Aa])(?= [aeiou])")
GENERATORS = [story, story, story, fact_sheet, qa, dialogue, arithmetic, counting, shopping]


def make_docs(n_docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        parts = [rng.choice(GENERATORS)(rng) for _ in range(rng.randint(1, 3))]
        # the templates always write "a"; fix the article once here
        docs.append(_ARTICLE.sub(r"\1n", "\n\n".join(parts)))
    return docs


def main(argv: list[str] | None = None) -> int:
    p = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/corpus", help="output folder")
    p.add_argument("--docs", type=int, help="number of documents (default 3000; synthetic corpus only)")
    p.add_argument("--shards", type=int, default=2, help="number of JSONL files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="train", help="file name prefix: <name>-00000.jsonl, ...")
    p.add_argument("--force", action="store_true", help="replace the <name>-*.jsonl shards already in --out")
    from_files.add_arguments(p)
    try:
        args = p.parse_args(argv)
        from_files.check_mode(args, ["--docs"] if args.docs is not None else [])
        if args.from_files:
            from_files.write(*from_files.build(args))
            return 0
        if args.shards < 1 or (args.docs is not None and args.docs < 1):
            raise UserError(f"--shards and --docs must be at least 1, got --shards {args.shards}, --docs {args.docs}")
        out = Path(args.out)
        check_writable(out, "--out")
        earlier = sorted(out.glob(f"{args.name}-[0-9][0-9][0-9][0-9][0-9].jsonl"))
        if not args.force:
            refuse_to_overwrite(earlier)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    docs = make_docs(3000 if args.docs is None else args.docs, args.seed)
    for path in from_files.replace_shards(out, args.name, docs, args.shards):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
