import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, run_script
from trainer.data.loader import build_dataloader
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

DOCS = [
    f"Document {i}: the {c} cat sat on the mat and counted to {i * 7}." * (1 + i % 4)
    for i, c in enumerate(["red", "blue", "green", "old", "small", "happy", "brave"] * 3)
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ROOT / "data" / "tokenizer.model"))


@pytest.fixture()
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def stream(tok: Tokenizer, docs: list[str]) -> list[int]:
    return [t for d in docs for t in tok.encode(d, bos=True, eos=True)]


def loader(tok: Tokenizer, path: Path | str, *, seq_len: int = 16, batch_size: int = 2,
           dp_rank: int = 0, dp_degree: int = 1, **kw):
    return build_dataloader(
        kind="pretrain", path=str(path), tokenizer=tok, seq_len=seq_len, batch_size=batch_size,
        dp_rank=dp_rank, dp_degree=dp_degree, seed=0, **kw,
    )


def take(it: Iterator, n: int) -> list[dict[str, torch.Tensor]]:
    return [next(it) for _ in range(n)]


def test_packing_and_shift(tok: Tokenizer, jsonl: Path) -> None:
    seq_len, b = 16, 2
    tokens = stream(tok, DOCS)
    batches = take(iter(loader(tok, jsonl, seq_len=seq_len, batch_size=b)), 5)
    for m, batch in enumerate(batches):
        assert set(batch) == {"input_ids", "labels"}
        assert batch["input_ids"].shape == batch["labels"].shape == (b, seq_len)
        assert batch["input_ids"].dtype == torch.long
        for i in range(b):
            w = (m * b + i) * (seq_len + 1)
            window = tokens[w:w + seq_len + 1]
            assert batch["input_ids"][i].tolist() == window[:-1]
            assert batch["labels"][i].tolist() == window[1:]


def test_epochs_wrap(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    docs = DOCS[:3]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokens = stream(tok, docs)
    seq_len = 8
    dl = loader(tok, path, seq_len=seq_len, batch_size=1)
    n = 3 * len(tokens) // (seq_len + 1)
    got = [t for b in take(iter(dl), n) for t in b["input_ids"][0].tolist()]
    expected = [
        (tokens * 4)[k * (seq_len + 1) + j] for k in range(n) for j in range(seq_len)
    ]
    assert got == expected
    assert dl.dataset.stats()["epoch"] == 2


def test_state_round_trip(tok: Tokenizer, jsonl: Path) -> None:
    # small windows inside long documents: the state has to carry a token offset;
    # one resume point lies in the second epoch
    per_epoch = len(stream(tok, DOCS)) // (6 * 3)
    n = per_epoch + 12
    ref = take(iter(loader(tok, jsonl, seq_len=5, batch_size=3)), n)
    states = []
    for k in (0, 1, 7, per_epoch + 3):
        dl = loader(tok, jsonl, seq_len=5, batch_size=3)
        it = iter(dl)
        take(it, k)
        state = copy.deepcopy(dl.state_dict())
        states.append(state["dataset_state"])
        resumed = loader(tok, jsonl, seq_len=5, batch_size=3)
        resumed.load_state_dict(state)
        for a, b in zip(take(iter(resumed), n - k), ref[k:], strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"])
            assert torch.equal(a["labels"], b["labels"])
    assert states[-1]["epoch"] == 1
    assert any(s["offset"] > 0 for s in states)


def test_state_is_plain_and_dp_independent(tok: Tokenizer, jsonl: Path) -> None:
    states = []
    for rank in range(2):
        dl = loader(tok, jsonl, batch_size=2, dp_rank=rank, dp_degree=2)
        take(iter(dl), 3)
        states.append(dl.state_dict()["dataset_state"])
    dl = loader(tok, jsonl, batch_size=4)
    take(iter(dl), 3)
    assert states[0] == states[1] == dl.state_dict()["dataset_state"]
    assert json.loads(json.dumps(states[0])) == states[0]
    assert states[0]["windows"] == 12


def global_steps(tok: Tokenizer, path: Path, dp: int, steps: int, state=None) -> list[list[list[int]]]:
    """Windows of each step across all dp ranks, rank-major (the global batch)."""
    per_rank = []
    for rank in range(dp):
        dl = loader(tok, path, batch_size=8 // dp, dp_rank=rank, dp_degree=dp)
        if state is not None:
            dl.load_state_dict(copy.deepcopy(state))
        per_rank.append(take(iter(dl), steps))
    return [
        [row for rank in range(dp) for row in per_rank[rank][s]["input_ids"].tolist()]
        for s in range(steps)
    ]


def test_same_global_batch_for_any_dp_degree(tok: Tokenizer, jsonl: Path) -> None:
    one = global_steps(tok, jsonl, dp=1, steps=6)
    assert global_steps(tok, jsonl, dp=2, steps=6) == one
    assert global_steps(tok, jsonl, dp=4, steps=6) == one
    assert len({tuple(r) for step in one for r in step}) == 48  # no window twice


def test_resume_at_another_dp_degree(tok: Tokenizer, jsonl: Path) -> None:
    ref = global_steps(tok, jsonl, dp=1, steps=10)
    dl = loader(tok, jsonl, batch_size=8)
    take(iter(dl), 4)
    state = dl.state_dict()
    assert global_steps(tok, jsonl, dp=2, steps=6, state=state) == ref[4:]
    # and back: a dp=2 state (rank 1's) resumes at dp=1
    dl = loader(tok, jsonl, batch_size=4, dp_rank=1, dp_degree=2)
    take(iter(dl), 7)
    assert global_steps(tok, jsonl, dp=1, steps=3, state=dl.state_dict()) == ref[7:]


def test_gradient_accumulation_is_just_more_micro_batches(tok: Tokenizer, jsonl: Path) -> None:
    # 2 micro-batches of 4 on one rank == 1 micro-batch of 4 on each of 2 ranks, step by step
    one = take(iter(loader(tok, jsonl, batch_size=4)), 4)
    two = [take(iter(loader(tok, jsonl, batch_size=2, dp_rank=r, dp_degree=2)), 4) for r in range(2)]
    for m in range(4):
        assert one[m]["input_ids"].tolist() == (
            two[0][m]["input_ids"].tolist() + two[1][m]["input_ids"].tolist()
        )


def test_text_jsonl_parquet_and_folder_agree(tok: Tokenizer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d.replace("\n", " ") for d in DOCS]
    (tmp_path / "d.txt").write_text("\n".join(docs) + "\n\n")  # blank lines are skipped
    pq.write_table(pa.table({"body": docs}), tmp_path / "d.parquet")
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(3):
        (folder / f"part-{i}.jsonl").write_text(
            "".join(json.dumps({"text": d}) + "\n\n" for d in docs[i * 7:(i + 1) * 7])
        )
    tokens = stream(tok, docs)
    sources = [
        (tmp_path / "d.txt", {}),
        (tmp_path / "d.parquet", {"text_field": "body"}),
        (folder, {}),
        (tmp_path / "d.txt", {"data_format": "text"}),
    ]
    for path, kw in sources:
        batch = next(iter(loader(tok, path, seq_len=len(tokens) // 2 - 1, batch_size=2, **kw)))
        got = torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1).flatten().tolist()
        assert got == tokens[: len(got)], path


def test_parquet_state_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": DOCS}), path)
    ref = take(iter(loader(tok, path)), 20)
    dl = loader(tok, path)
    take(iter(dl), 13)
    resumed = loader(tok, path)
    resumed.load_state_dict(dl.state_dict())
    assert [b["input_ids"].tolist() for b in take(iter(resumed), 7)] == [
        b["input_ids"].tolist() for b in ref[13:]
    ]


def test_json_array_file(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "docs.json"
    path.write_text(json.dumps([{"text": d} for d in DOCS], indent=1))
    batch = next(iter(loader(tok, path, seq_len=30, batch_size=1)))
    assert batch["input_ids"][0].tolist() == stream(tok, DOCS)[:30]


def error_of(tok: Tokenizer, path: Path | str, **kw) -> str:
    with pytest.raises(UserError) as e:
        next(iter(loader(tok, path, **kw)))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_path(tok: Tokenizer, tmp_path: Path) -> None:
    assert error_of(tok, tmp_path / "nope.jsonl") == f"data.path not found: {tmp_path / 'nope.jsonl'}"
    assert "data.path not found" in error_of(tok, "tests/no_such_folder")


def test_empty_data(tok: Tokenizer, tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    assert "is empty" in error_of(tok, tmp_path / "empty.jsonl")
    (tmp_path / "blank.jsonl").write_text('\n{"text": ""}\n{"text": "   "}\n')
    assert "has no documents" in error_of(tok, tmp_path / "blank.jsonl")
    (tmp_path / "nodata").mkdir()
    assert error_of(tok, tmp_path / "nodata") == (
        f"data.path folder {tmp_path / 'nodata'} has no data files (.jsonl, .json, .parquet, .txt)"
    )


def test_a_glob_reads_its_files_in_name_order(tok: Tokenizer, tmp_path: Path) -> None:
    for name, docs in (("b-1.jsonl", DOCS[3:]), ("a-0.jsonl", DOCS[:3]), ("notes.jsonl", ["not matched"])):
        (tmp_path / name).write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    batch = next(iter(loader(tok, tmp_path / "?-*.jsonl", seq_len=60, batch_size=1)))
    assert batch["input_ids"][0].tolist() == stream(tok, DOCS)[:60]
    assert error_of(tok, tmp_path / "*.parquet") == (
        f"data.path glob {tmp_path / '*.parquet'} matches no data files (.jsonl, .json, .parquet, .txt)"
    )
    (tmp_path / "c.txt").write_text("text\n")
    assert "data.path glob" in error_of(tok, tmp_path / "*") and "mixes formats" in error_of(tok, tmp_path / "*")


def test_a_corpus_shorter_than_one_sequence_is_refused(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": "a few words"}) + "\n")
    tokens = len(stream(tok, ["a few words"]))
    assert error_of(tok, path, seq_len=64) == (
        f"data {path} holds {tokens} tokens, fewer than one sequence of seq_len + 1 = 65: every sequence "
        "would repeat it; give more data or lower training.seq_len"
    )
    assert error_of(tok, path, seq_len=64, option="validation.path").startswith(f"validation.path {path} holds")


def test_errors_of_held_out_data_name_validation_path(tok: Tokenizer, tmp_path: Path) -> None:
    held_out = {"option": "validation.path"}
    assert error_of(tok, tmp_path / "nope.jsonl", **held_out) == f"validation.path not found: {tmp_path / 'nope.jsonl'}"
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    assert error_of(tok, path, **held_out) == f"validation.path {path}:2: field 'text' must be a string, got int"
    path.write_text('{"text": ""}\n')
    assert error_of(tok, path, **held_out) == f"validation.path {path} has no documents (no non-empty 'text')"


def test_bad_json_line(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "also fine"}\n{"text": oops}\n')
    assert error_of(tok, path).startswith(f"{path}:4: not valid JSON")
    path.write_text('{"text": "fine"}\n[1, 2]\n')
    assert error_of(tok, path) == f"{path}:2: expected a JSON object, got list"


def test_missing_or_wrong_field(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    assert error_of(tok, path) == f"{path}:2: missing field 'text' (fields: body)"
    path.write_text('{"text": "fine"}\n{"text": 3}\n')
    assert error_of(tok, path) == f"{path}:2: field 'text' must be a string, got int"
    path.write_text('{"content": "x"}\n')
    batch = next(iter(loader(tok, path, text_field="content", seq_len=2, batch_size=1)))
    assert batch["input_ids"][0].tolist() == tok.encode("x", bos=True, eos=True)[:2]


def test_parquet_errors_name_file_and_row(tok: Tokenizer, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b c"] * 3}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["d e f", None]}), tmp_path / "b.parquet")
    msg = error_of(tok, tmp_path, seq_len=64)
    assert msg == f"{tmp_path / 'b.parquet'} row 1: missing field 'text' (fields: text)"


def test_bad_format_and_arguments(tok: Tokenizer, jsonl: Path, tmp_path: Path) -> None:
    assert error_of(tok, jsonl, data_format="csv") == (
        "unknown data format 'csv' (expected one of: auto, text, jsonl, parquet)"
    )
    (tmp_path / "x.csv").write_text("a,b\n")
    assert "cannot tell the format" in error_of(tok, tmp_path / "x.csv")
    (tmp_path / "notes.txt").write_text("hello\n")
    assert "mixes formats" in error_of(tok, tmp_path)
    with pytest.raises(UserError, match="unknown data kind 'books'"):
        build_dataloader(kind="books", path=str(jsonl), tokenizer=tok, seq_len=8, batch_size=1,
                         dp_rank=0, dp_degree=1, seed=0)
    with pytest.raises(UserError, match=r"dp_rank 2 is outside \[0, 2\)"):
        loader(tok, jsonl, dp_rank=2, dp_degree=2)


def test_state_of_another_kind_is_refused(tok: Tokenizer, jsonl: Path) -> None:
    dl = loader(tok, jsonl)
    state = dl.state_dict()
    state["dataset_state"] = {"kind": "sft", "epoch": 0}
    resumed = loader(tok, jsonl)
    resumed.load_state_dict(state)
    with pytest.raises(UserError, match="data loader state does not fit this pretrain loader"):
        next(iter(resumed))


def test_shipped_corpus(tok: Tokenizer) -> None:
    files = sorted((ROOT / "data" / "corpus").glob("*.jsonl"))
    assert files and sum(f.stat().st_size for f in files) < 3_000_000
    dl = loader(tok, ROOT / "data" / "corpus", seq_len=256, batch_size=8)
    batch = next(iter(dl))
    assert batch["input_ids"].shape == (8, 256)
    assert int(batch["input_ids"].max()) < tok.n_words


def test_shipped_corpus_is_reproducible(tmp_path: Path) -> None:
    result = run_script("scripts/make_corpus.py", ["--out", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    shipped = sorted((ROOT / "data" / "corpus").iterdir())
    assert [f.name for f in sorted(tmp_path.iterdir())] == [f.name for f in shipped]
    for f in shipped:
        assert (tmp_path / f.name).read_bytes() == f.read_bytes(), f.name
