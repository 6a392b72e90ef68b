"""make_corpus.py --from-files (scripts/corpus/from_files.py): shards, held-out split, refusals."""

import json
import os
import shutil
import types
from pathlib import Path

import pytest

from scripts import make_corpus
from scripts.corpus import from_files as file_corpus
from scripts.corpus.from_files import is_heldout
from trainer.data.globbing import glob_root

TEXTS = {
    "a.py": "import os\n\n\ndef f():\n    return 1\n",
    "b.txt": "plain text file\n",
    "pkg/__init__.py": "from .m import g\n",
    "pkg/m.py": "def g(x):\n        return x * 2\n",
    "pkg/deep/er/x.py": "X = 'caf\u00e9'\n",
    "pkg/deep/y.py": "class Y:\n    pass\n",
    "docs/readme.md": "# title\n\nsome words\n",
    "docs/notes.txt": "notes\n",
    "z.py": "print('z')\n",
}
DUPLICATE = "pkg/copy_of_a.py"  # same text as a.py, sorts after it: dropped
HELDOUT = ["--heldout-pct", "40"]


def plant(root: Path) -> Path:
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / DUPLICATE).write_text(TEXTS["a.py"], encoding="utf-8")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (root / "empty.py").write_text("")
    (root / "site-packages" / "lib").mkdir(parents=True)
    (root / "site-packages" / "lib" / "installed.py").write_text("installed = True\n")
    return root


def shards(folder: Path, name: str) -> list[str]:
    return [json.loads(line)["text"] for p in sorted(folder.glob(f"{name}-*.jsonl"))
            for line in p.read_text(encoding="utf-8").splitlines()]


def run(src: Path, out: Path, *extra: str) -> int:
    return make_corpus.main(["--from-files", f"{src}/**/*", "--out", str(out / "train"),
                             "--heldout-out", str(out / "held"), *HELDOUT, *extra])


def test_every_kept_file_once_and_the_splits_share_nothing(tmp_path, capsys):
    src = plant(tmp_path / "src")
    assert run(src, tmp_path, "--shards", "3") == 0
    train, held = shards(tmp_path / "train", "train"), shards(tmp_path / "held", "valid")
    assert sorted(train + held) == sorted(TEXTS.values())  # no duplicate, no skipped or excluded file
    assert train and held and not set(train) & set(held)
    assert sorted(held) == sorted(t for n, t in TEXTS.items() if is_heldout(n, 40))
    assert len(list((tmp_path / "train").glob("train-*.jsonl"))) == 3
    assert [p.name for p in (tmp_path / "held").iterdir()] == ["valid-00000.jsonl"]
    lines = capsys.readouterr().out.splitlines()
    names = [*TEXTS, DUPLICATE, "latin1.txt", "empty.py"]  # what is read, not excluded
    assert lines[0].startswith(f"train: {sum(not is_heldout(n, 40) for n in names)} files")
    assert "1 not UTF-8" in "".join(lines[:2]) and "1 empty" in "".join(lines[:2])
    assert "1 duplicate text" in "".join(lines[:2])
    assert lines[1].startswith(f"held-out: {sum(is_heldout(n, 40) for n in names)} files") and lines[2] == "excluded: 1 files under --exclude directories"


def test_split_and_order_do_not_depend_on_where_the_tree_lies(tmp_path):
    src = plant(tmp_path / "src")
    assert run(src, tmp_path / "one") == 0
    moved = tmp_path / "elsewhere" / "deeper" / "lib"
    shutil.move(str(src), str(moved))
    assert run(moved, tmp_path / "two") == 0
    for folder, name in (("train", "train"), ("held", "valid")):
        assert shards(tmp_path / "one" / folder, name) == shards(tmp_path / "two" / folder, name)
    assert run(moved, tmp_path / "three", "--seed", "1") == 0
    assert sorted(shards(tmp_path / "three" / "train", "train")) == sorted(shards(tmp_path / "one" / "train", "train"))


def test_glob_root_is_the_part_before_the_first_wildcard():
    assert glob_root("/usr/lib/python3.11/**/*.py") == "/usr/lib/python3.11"
    assert glob_root("src/a[bc]/*.py") == "src"
    assert glob_root("**/*.py") == "."
    assert glob_root("/data/one.txt") == "/data"


def refused(capsys, code: int, message: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {message}\n"


def test_refusals(tmp_path, capsys):
    src = plant(tmp_path / "src")
    out, held = str(tmp_path / "out"), str(tmp_path / "held")
    files = ["--from-files", f"{src}/**/*"]
    refused(capsys, make_corpus.main([*files, "--out", out]),
            "--from-files needs --heldout-out FOLDER for the held-out split")
    refused(capsys, make_corpus.main(["--from-files", f"{src}/**/*.nothing", "--out", out, "--heldout-out", held]),
            f"no file matches {src}/**/*.nothing")
    refused(capsys, make_corpus.main(["--from-files", f"{src}/latin1.txt", f"{src}/empty.py",
                                      "--out", out, "--heldout-out", held]),
            "all 2 matched files were skipped (1 not UTF-8, 1 empty)")
    refused(capsys, make_corpus.main([*files, "--out", out, "--heldout-out", held, "--heldout-pct", "0"]),
            f"the held-out split would be empty (none of the {len(TEXTS)} documents falls in "
            "--heldout-pct 0); raise --heldout-pct")
    refused(capsys, make_corpus.main([*files, "--out", out, "--heldout-out", held, "--heldout-pct", "100"]),
            f"the held-out split would take every file ({len(TEXTS)} of {len(TEXTS)} documents at "
            "--heldout-pct 100); lower --heldout-pct")
    refused(capsys, make_corpus.main([*files, "--out", out, "--heldout-out", out, "--name", "valid"]),
            "--out and --heldout-out are the same folder and both name their shards valid-*.jsonl; "
            "choose another --heldout-out or --name")
    refused(capsys, make_corpus.main([*files, "--out", out, "--heldout-out", held, "--docs", "5"]),
            "--docs is for the synthetic corpus; it cannot be mixed with --from-files")
    refused(capsys, make_corpus.main(["--out", out, "--heldout-out", held]), "--heldout-out needs --from-files")
    refused(capsys, make_corpus.main(["--out", out, "--heldout-pct", "5"]), "--heldout-pct needs --from-files")
    assert not (tmp_path / "out").exists() and not (tmp_path / "held").exists()  # nothing written
    # same folder, different prefixes: fine
    assert make_corpus.main([*files, "--out", out, "--heldout-out", out, *HELDOUT]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "train-00000.jsonl", "train-00001.jsonl", "valid-00000.jsonl"]


def test_force_replaces_the_earlier_shards_of_both_splits(tmp_path, capsys):
    src = plant(tmp_path / "src")
    assert run(src, tmp_path, "--shards", "3") == 0
    capsys.readouterr()
    refused(capsys, run(src, tmp_path, "--shards", "1"),
            f"{tmp_path / 'train' / 'train-00000.jsonl'} exists; pass --force to overwrite it, or choose another --out")
    shutil.rmtree(tmp_path / "train")
    refused(capsys, run(src, tmp_path, "--shards", "1"),
            f"{tmp_path / 'held' / 'valid-00000.jsonl'} exists; pass --force to overwrite it, or choose another --out")
    (tmp_path / "train").mkdir()
    for i in range(3):
        (tmp_path / "train" / f"train-{i:05d}.jsonl").write_text('{"text": "stale"}\n')
    (tmp_path / "train" / "other.jsonl").write_text("kept\n")
    assert run(src, tmp_path, "--shards", "1", "--heldout-shards", "2", "--force") == 0
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["other.jsonl", "train-00000.jsonl"]
    assert sorted(p.name for p in (tmp_path / "held").iterdir()) == ["valid-00000.jsonl", "valid-00001.jsonl"]
    assert "stale" not in shards(tmp_path / "train", "train")



@pytest.mark.timeout(60)
def test_link_loops_fifos_and_special_filesystems_are_not_followed(tmp_path, capsys):
    src = plant(tmp_path / "src")
    # Two links back up: a recursive glob that follows them walks 2^depth paths, for ever in practice.
    (src / "pkg" / "loop").symlink_to(src, target_is_directory=True)
    (src / "docs" / "up").symlink_to(src, target_is_directory=True)
    os.mkfifo(src / "pipe.txt")  # reading it would block
    assert run(src, tmp_path) == 0
    assert sorted(shards(tmp_path / "train", "train") + shards(tmp_path / "held", "valid")) == sorted(TEXTS.values())
    capsys.readouterr()
    assert make_corpus.main(["--from-files", "/proc/**/*", "--out", str(tmp_path / "p"),
                             "--heldout-out", str(tmp_path / "ph")]) == 2
    assert capsys.readouterr().err.startswith("error: --from-files /proc/**/*: /proc is a special filesystem")


def test_force_keeps_the_earlier_corpus_when_writing_fails(tmp_path, monkeypatch):
    src = plant(tmp_path / "src")
    assert run(src, tmp_path) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "train").iterdir()}
    written = 0

    def full_disk(obj):
        nonlocal written
        written += 1
        if written == 3:
            raise OSError(28, "No space left on device")
        return json.dumps(obj)

    monkeypatch.setattr(file_corpus, "json", types.SimpleNamespace(dumps=full_disk))
    with pytest.raises(OSError):
        run(src, tmp_path, "--force")
    assert {p.name: p.read_bytes() for p in (tmp_path / "train").iterdir()} == before
