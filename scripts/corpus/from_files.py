"""A pretraining corpus from text files on this machine, for `make_corpus.py --from-files`.

Each file is one document. Files that are not UTF-8, are empty (whitespace only) or are
larger than --max-file-bytes are skipped and counted, and a file whose text repeats an
earlier file's (sha1 of the text; the first in sorted path order is kept) is dropped. The
held-out split takes whole files: those whose path relative to the glob's root (the part of
the pattern before its first wildcard) has a sha1 below --heldout-pct, so the same files go
to held-out wherever the tree lies (`/usr/lib/python3.11` or `~/.pyenv/.../python3.11`).
Files under a directory named in --exclude (site-packages, dist-packages and __pycache__ by
default: what is installed there differs from machine to machine) are not read.

Nothing is written before every check has passed; both splits are shuffled with --seed so
the shards are not sorted by directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePath

from trainer.data.globbing import SPECIAL_FILESYSTEMS, glob_files, glob_root
from trainer.errors import UserError
from trainer.run_folder import refuse_to_overwrite

HELDOUT_NAME = "valid"
DEFAULTS = {
    "heldout_pct": 2.0,
    "heldout_shards": 1,
    "max_file_bytes": 1_000_000,
    "exclude": ["site-packages", "dist-packages", "__pycache__"],
}
SKIPS = ("not UTF-8", "empty", "over --max-file-bytes", "unreadable", "duplicate text")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The --from-files options; their defaults are None so that mixing the modes is caught."""
    g = p.add_argument_group("a corpus from files (--from-files)")
    g.add_argument("--from-files", nargs="+", metavar="GLOB",
                   help="text files, one document each; recursive globs ('**') allowed")
    g.add_argument("--heldout-out", metavar="FOLDER", help="held-out folder (valid-*.jsonl); required")
    g.add_argument("--heldout-pct", type=float, help="percent of the files held out (default 2.0)")
    g.add_argument("--heldout-shards", type=int, help="number of held-out JSONL files (default 1)")
    g.add_argument("--max-file-bytes", type=int, help="skip larger files (default 1000000)")
    g.add_argument("--exclude", nargs="*", metavar="DIR",
                   help="skip files under directories of these names (fnmatch patterns; default "
                        "site-packages dist-packages __pycache__; give no name to exclude nothing)")


def check_mode(args: argparse.Namespace, synthetic_given: list[str]) -> None:
    """Refuse options of one mode given to the other; fill in the --from-files defaults."""
    given = [f"--{k.replace('_', '-')}" for k in DEFAULTS if getattr(args, k) is not None]
    if args.heldout_out is not None:
        given.insert(0, "--heldout-out")
    if not args.from_files:
        if given:
            raise UserError(f"{given[0]} needs --from-files")
        return
    if synthetic_given:
        raise UserError(f"{synthetic_given[0]} is for the synthetic corpus; it cannot be mixed with --from-files")
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)
    if args.heldout_out is None:
        raise UserError("--from-files needs --heldout-out FOLDER for the held-out split")
    for option in ("shards", "heldout_shards", "max_file_bytes"):
        if getattr(args, option) < 1:
            raise UserError(f"--{option.replace('_', '-')} must be at least 1")
    if Path(args.out).resolve() == Path(args.heldout_out).resolve() and args.name == HELDOUT_NAME:
        raise UserError(f"--out and --heldout-out are the same folder and both name their shards "
                      f"{HELDOUT_NAME}-*.jsonl; choose another --heldout-out or --name")


def check_not_special(pattern: str) -> None:
    """Refuse a pattern whose fixed part lies in /proc, /sys or /dev: their files are the kernel's, not text."""
    real = os.path.realpath(glob_root(pattern))
    for special in SPECIAL_FILESYSTEMS:
        if real == special or real.startswith(special + "/"):
            raise UserError(f"--from-files {pattern}: {special} is a special filesystem of the kernel (its files are "
                          "not text, and some never end); give folders of text files")


def matched_files(patterns: list[str], exclude: list[str]) -> tuple[list[tuple[str, str]], int]:
    """(path, path relative to its glob's root) of the files matched, in pattern then name order,
    each file once (by resolved path); and how many were left out by `exclude`. Only regular files
    are read (not a FIFO, which would block, nor a device)."""
    seen: set[str] = set()
    found, excluded = [], 0
    for pattern in patterns:
        check_not_special(pattern)
        root = glob_root(pattern)
        for path in glob_files(pattern):
            if not os.path.isfile(path):
                continue
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            rel = PurePath(os.path.relpath(path, root)).as_posix()
            if any(fnmatch(d, x) for d in rel.split("/")[:-1] for x in exclude):
                excluded += 1
                continue
            found.append((path, rel))
    return found, excluded


def is_heldout(rel: str, pct: float) -> bool:
    """Whether the file at `rel` (relative to its glob's root, '/'-separated) is held out."""
    h = int.from_bytes(hashlib.sha1(rel.encode("utf-8")).digest()[:8], "big")
    return h < pct / 100 * 2**64


@dataclass
class Split:
    folder: Path
    name: str
    shards: int
    files: int = 0
    docs: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIPS, 0))

    def summary(self, label: str) -> str:
        mb = sum(len(d.encode("utf-8")) for d in self.docs) / 1e6
        skips = ", ".join(f"{n} {why}" for why, n in self.skipped.items() if n) or "none"
        return (f"{label}: {self.files} files -> {len(self.docs)} documents, {mb:.1f} MB of text in "
                f"{self.shards} shard{'s' if self.shards > 1 else ''} {self.folder}/{self.name}-*.jsonl "
                f"(skipped: {skips})")


class Progress:
    """A line on stderr every few seconds while the files are read: a large tree takes minutes."""

    EVERY_S = 5.0

    def __init__(self, total: int) -> None:
        self.total, self.done, self.last = total, 0, time.monotonic()

    def tick(self) -> None:
        self.done += 1
        if time.monotonic() - self.last >= self.EVERY_S:
            self.last = time.monotonic()
            print(f"read {self.done} of {self.total} files", file=sys.stderr, flush=True)


def read_document(path: str, max_bytes: int) -> tuple[str | None, str | None]:
    """(text, None) for a usable file, else (None, why it is skipped)."""
    try:
        if os.path.getsize(path) > max_bytes:
            return None, "over --max-file-bytes"
        raw = Path(path).read_bytes()
    except OSError:
        return None, "unreadable"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    return (text, None) if text.strip() else (None, "empty")


def build(args: argparse.Namespace) -> tuple[Split, Split, int]:
    """Read and split the files (train, held-out, files excluded); raises UserError, writes nothing."""
    train = Split(Path(args.out), args.name, args.shards)
    heldout = Split(Path(args.heldout_out), HELDOUT_NAME, args.heldout_shards)
    earlier = [p for s in (train, heldout) for p in sorted(s.folder.glob(f"{s.name}-[0-9][0-9][0-9][0-9][0-9].jsonl"))]
    if not args.force:
        refuse_to_overwrite(earlier)
    files, excluded = matched_files(args.from_files, args.exclude)
    if not files:
        more = f" ({excluded} under --exclude directories)" if excluded else ""
        raise UserError(f"no file matches {' '.join(args.from_files)}{more}")
    texts: set[bytes] = set()
    progress = Progress(len(files))
    for path, rel in files:
        progress.tick()
        split = heldout if is_heldout(rel, args.heldout_pct) else train
        split.files += 1
        text, why = read_document(path, args.max_file_bytes)
        if text is not None:
            digest = hashlib.sha1(text.encode("utf-8")).digest()
            why = "duplicate text" if digest in texts else None
            texts.add(digest)
        if why:
            split.skipped[why] += 1
        else:
            split.docs.append(text)
    kept = len(train.docs) + len(heldout.docs)
    if not kept:
        skips = {k: train.skipped[k] + heldout.skipped[k] for k in SKIPS}
        raise UserError(f"all {len(files)} matched files were skipped ("
                      + ", ".join(f"{n} {why}" for why, n in skips.items() if n) + ")")
    if not heldout.docs:
        raise UserError(f"the held-out split would be empty (none of the {kept} documents falls in "
                      f"--heldout-pct {args.heldout_pct:g}); raise --heldout-pct")
    if not train.docs:
        raise UserError(f"the held-out split would take every file ({kept} of {kept} documents at "
                      f"--heldout-pct {args.heldout_pct:g}); lower --heldout-pct")
    for split in (train, heldout):
        random.Random(args.seed).shuffle(split.docs)
    return train, heldout, excluded


def write_shards(split: Split) -> None:
    """Replace the split's earlier <name>-*.jsonl shards with its documents, one {"text": ...} a line."""
    replace_shards(split.folder, split.name, split.docs, split.shards)


def replace_shards(folder: Path, name: str, docs: list[str], shards: int) -> list[Path]:
    """Write `docs` as `shards` files <name>-NNNNN.jsonl in `folder`, replacing its earlier ones; the paths.

    Every new shard is written in full under a temporary name first: a failure (a full disk) removes
    them and leaves the earlier corpus as it was. Then each is renamed over its old name, and earlier
    shards beyond the new count are removed.
    """
    folder.mkdir(parents=True, exist_ok=True)
    earlier = set(folder.glob(f"{name}-[0-9][0-9][0-9][0-9][0-9].jsonl"))
    per = -(-len(docs) // shards)
    written: list[tuple[Path, Path]] = []
    try:
        for i in range(shards):
            final = folder / f"{name}-{i:05d}.jsonl"
            temporary = folder / f".{final.name}.{os.getpid()}.partial"
            written.append((temporary, final))
            with open(temporary, "w", encoding="utf-8", newline="\n") as f:
                for d in docs[i * per:(i + 1) * per]:
                    f.write(json.dumps({"text": d}) + "\n")
    except BaseException:
        for temporary, _ in written:
            temporary.unlink(missing_ok=True)
        raise
    for temporary, final in written:
        os.replace(temporary, final)
        earlier.discard(final)
    for old in earlier:
        old.unlink()
    return [final for _, final in written]


def write(train: Split, heldout: Split, excluded: int) -> None:
    for split, label in ((train, "train"), (heldout, "held-out")):
        write_shards(split)
        print(split.summary(label))
    if excluded:
        print(f"excluded: {excluded} files under --exclude directories")
