"""Bad data rows (issue #11, item 3): found before any work when the data is small enough to
check whole, otherwise when reached (the run then stops with a checkpoint of the last completed
step, naming the step), or skipped and counted with ``data.bad_rows = "skip"``.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

import trainer.data.loader
import trainer.data.source
from tests.helpers import ROOT, read_metrics, run_train
from tests.trainer.test_faults import SMALL, checkpoints, error_line, ok
from trainer.data.loader import build_dataloader
from trainer.data.sft import SFTOptions
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

ALPACA = {"instruction": "Reverse the words.", "input": "cat dog owl", "output": "owl dog cat"}
BAD_JSON = b'{"text": oops}'
JSON_PROBLEM = "not valid JSON (JSONDecodeError: Expecting value: line 1 column 10 (char 9))"
NOT_UTF8 = b'{"text": "caf\xe9 au lait"}'
NOT_UTF8_COLUMN = NOT_UTF8.index(b"\xe9") + 1


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ROOT / "data" / "tokenizer.model"))


def doc(i: int) -> bytes:
    return json.dumps({"text": f"Document {i}: the cat sat on the mat."}).encode()


def write_rows(path: Path, n: int, bad: dict[int, bytes], row=doc) -> Path:
    """`n` lines of JSON Lines, line k (1-based) replaced by bad[k]."""
    path.write_bytes(b"".join(bad.get(k, row(k)) + b"\n" for k in range(1, n + 1)))
    return path


def alpaca(i: int) -> bytes:
    return json.dumps({**ALPACA, "input": f"cat dog owl {i}"}).encode()


def loader(tok: Tokenizer, path: Path, *, kind: str = "pretrain", batch_size: int = 2,
           dp_rank: int = 0, dp_degree: int = 1, **kw):
    return build_dataloader(kind=kind, path=str(path), tokenizer=tok, seq_len=16, batch_size=batch_size,
                            dp_rank=dp_rank, dp_degree=dp_degree, seed=0, **kw)


def take(dl, n: int) -> list[list[list[int]]]:
    it = iter(dl)
    return [next(it)["input_ids"].tolist() for _ in range(n)]


# -- before the first step ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "row", "bad", "problem"), [
    ("pretrain", doc, BAD_JSON, JSON_PROBLEM),
    ("pretrain", doc, NOT_UTF8, f"not valid UTF-8 (byte 0xe9 at column {NOT_UTF8_COLUMN})"),
    ("pretrain", doc, b'{"body": "no text"}', "missing field 'text' (fields: body)"),
    ("pretrain", doc, b'{"text": 3}', "field 'text' must be a string, got int"),
    ("sft", alpaca, BAD_JSON, JSON_PROBLEM),
    ("sft", alpaca, NOT_UTF8, f"not valid UTF-8 (byte 0xe9 at column {NOT_UTF8_COLUMN})"),
    ("sft", alpaca, b'{"instruction": "x", "input": ""}', "missing field 'output'"),
])
def test_a_bad_row_stops_the_run_before_step_1(tmp_path, kind, row, bad, problem):
    # A 3-step run never reaches line 751: it used to finish without a word.
    data = write_rows(tmp_path / "data.jsonl", 1500, {751: bad}, row)
    dump = tmp_path / "run"
    proc = run_train(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "3",
                      "--data.kind", kind, "--data.path", str(data)])
    assert error_line(proc).startswith(f"error: {data}:751: {problem}")
    # Refused while the data was read, before the model was built: no startup summary, no step.
    assert "model llama2" not in proc.stdout and not (dump / "metrics.jsonl").exists()


def test_text_and_parquet_rows_are_checked_when_the_loader_is_built(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = tmp_path / "d.txt"
    text.write_bytes(b"one line\r\nanother\n\xffbad bytes\n" + b"word " * 100 + b"\n")
    with pytest.raises(UserError, match=f"^{re.escape(str(text))}:3: not valid UTF-8 \\(byte 0xff at column 1\\)$"):
        loader(tok, text)
    pq.write_table(pa.table({"text": ["a b c", None, "d e f"]}), tmp_path / "d.parquet")
    with pytest.raises(UserError, match=r"d\.parquet row 1: missing field 'text'"):
        loader(tok, tmp_path / "d.parquet")
    dl = loader(tok, text, bad_rows="skip")
    take(dl, 1)  # lines 1, 2 and 4: line 3 is passed once
    assert dl.dataset.stats()["epoch"] == 0 and dl.dataset.stats()["bad_rows"] == 1


def test_every_row_bad_is_an_error_even_when_skipping(tok, tmp_path):
    data = write_rows(tmp_path / "d.jsonl", 3, {1: BAD_JSON, 2: NOT_UTF8, 3: b"[1]"})
    with pytest.raises(UserError, match="has no documents"):
        loader(tok, data, bad_rows="skip")
    with pytest.raises(UserError, match=f"^all 3 rows of SFT data {re.escape(str(data))} are bad, the first: "):
        loader(tok, data, kind="sft", bad_rows="skip")
    with pytest.raises(UserError, match="unknown bad_rows 'ignore'"):
        loader(tok, data, bad_rows="ignore")


def test_a_long_check_reports_progress(tok, tmp_path, monkeypatch, capsys):
    # as if the first row had taken over PROGRESS_AFTER_S, and the rest less than PROGRESS_EVERY_S
    monkeypatch.setattr(trainer.data.source, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(trainer.data.source, "PROGRESS_EVERY_S", 3600.0)
    data = write_rows(tmp_path / "d.jsonl", 300, {})
    loader(tok, data, verbose=True)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2, out
    assert re.fullmatch(rf"checking data {re.escape(str(data))} \(0\.\d MB\): at row 1 after 0 s", out[0])
    assert re.fullmatch(rf"checking data {re.escape(str(data))} \(0\.\d MB\): 300 rows in [\d.]+ s", out[1])
    loader(tok, data)  # not this process's to report
    assert capsys.readouterr().out == ""


# -- skipped ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_skipped_rows_are_warned_once_and_counted(tmp_path):
    data = write_rows(tmp_path / "data.jsonl", 1500, {3: BAD_JSON, 5: NOT_UTF8, 751: b'{"body": "x"}'})
    dump = tmp_path / "run"
    proc = run_train(["--job.dump_folder", str(dump), *SMALL, "--training.steps", "3",
                      "--data.path", str(data), "--data.bad_rows", "skip"])
    ok(proc)
    # Three steps end inside configs/debug.toml's warmup: that warning is not the one counted here.
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:") and "warmup_steps" not in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: skipping 3 bad rows of data {data} (data.bad_rows = 'skip'; counted as data/bad_rows), "
        f"the first: {data}:3: not valid JSON ("), proc.stderr
    # Three steps of 2 x 33 tokens pass lines 3 and 5, not line 751.
    assert [r["data/bad_rows"] for r in read_metrics(dump)][-1] == 2


def bad_stream(tmp_path: Path) -> Path:
    # bad rows first, last and between, so resume points fall around them in both epochs
    return write_rows(tmp_path / "d.jsonl", 40, {1: BAD_JSON, 7: NOT_UTF8, 8: b'{"body": 1}', 23: b"[]",
                                                 40: b'{"text": null}'})


def test_skipping_is_dp_independent_and_resumes_exactly(tok, tmp_path):
    data = bad_stream(tmp_path)
    n = 30  # more than an epoch of 16-token windows
    ref_dl = loader(tok, data, batch_size=4, bad_rows="skip")
    ref = take(ref_dl, n)
    # each pass over the data counts its 5 bad rows again
    assert ref_dl.dataset.stats()["epoch"] >= 1 and ref_dl.dataset.stats()["bad_rows"] > 5
    halves = [take(loader(tok, data, batch_size=2, dp_rank=r, dp_degree=2, bad_rows="skip"), n) for r in range(2)]
    assert [a + b for a, b in zip(*halves)] == ref
    for k in (1, 4, 17, 25):
        dl = loader(tok, data, batch_size=4, bad_rows="skip")
        take(dl, k)
        state = copy.deepcopy(dl.state_dict())
        resumed = loader(tok, data, batch_size=2, dp_rank=1, dp_degree=2, bad_rows="skip")
        resumed.load_state_dict(state)
        assert take(resumed, n - k) == [b[2:] for b in ref[k:]]
        assert resumed.dataset.stats()["bad_rows"] == ref_dl.dataset.stats()["bad_rows"]


def test_sft_skips_bad_rows_in_place_and_resumes_exactly(tok, tmp_path, capsys):
    data = write_rows(tmp_path / "d.jsonl", 30, {2: BAD_JSON, 11: b'{"instruction": "x"}'}, alpaca)
    dl = loader(tok, data, kind="sft", bad_rows="skip", verbose=True, sft_options=SFTOptions(pack=False))
    assert capsys.readouterr().err == (
        f"warning: skipping 2 bad rows of data {data} (data.bad_rows = 'skip'; counted as data/bad_rows), "
        f"the first: {data}:2: {JSON_PROBLEM}\n")
    ref = take(dl, 20)  # 40 samples: the 28 good rows of epoch 0, then into epoch 1
    stats = dl.dataset.stats()
    assert stats["epoch"] == 1 and stats["samples"] == 40
    assert stats["bad_rows"] == 2 + sum(i in (1, 10) for i in dl.dataset.order(1)[:stats["index"]])
    for k in (3, 13):
        first = loader(tok, data, kind="sft", bad_rows="skip", sft_options=SFTOptions(pack=False))
        take(first, k)
        resumed = loader(tok, data, kind="sft", bad_rows="skip", sft_options=SFTOptions(pack=False))
        resumed.load_state_dict(copy.deepcopy(first.state_dict()))
        assert take(resumed, 20 - k) == ref[k:]
        assert resumed.dataset.stats() == stats


# -- met mid-run --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_bad_row_met_mid_run_saves_the_last_step_and_names_it(tmp_path):
    data = write_rows(tmp_path / "data.jsonl", 60, {40: BAD_JSON})
    dump = tmp_path / "run"
    args = ["--job.dump_folder", str(dump), *SMALL, "--data.path", str(data),
            "--checkpoint.enable", "true", "--checkpoint.interval", "1000"]
    proc = run_train([*args, "--training.steps", "50"], script="tests/wrappers/train_unvalidated.py")
    line = error_line(proc)
    m = re.fullmatch(rf"error: step (\d+): {re.escape(str(data))}:40: not valid JSON \(.*\); "
                     r"checkpoint of step (\d+) saved \(data.bad_rows = \"skip\" skips such rows\)", line)
    assert m, line
    failed, saved = int(m[1]), int(m[2])
    assert saved == failed - 1 > 1
    # Saved although the interval is far off: the run's last completed step.
    assert checkpoints(dump) == [f"step-{saved}"]
    assert [r["step"] for r in read_metrics(dump)][-1] == saved

    proc = run_train([*args, "--training.steps", str(failed + 1), "--data.bad_rows", "skip"],
                     script="tests/wrappers/train_unvalidated.py")
    ok(proc)
    assert f"resumed from checkpoint at step {saved}" in proc.stdout
    assert f"the first: {data}:40: not valid JSON (" in proc.stderr
    rows = read_metrics(dump)
    assert [r["step"] for r in rows][-1] == failed + 1 and rows[-1]["data/bad_rows"] == 1


@pytest.mark.slow
def test_without_checkpoints_the_message_says_so(tmp_path):
    data = write_rows(tmp_path / "data.jsonl", 60, {40: BAD_JSON})
    proc = run_train(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--data.path", str(data),
                      "--training.steps", "50"], script="tests/wrappers/train_unvalidated.py")
    assert error_line(proc).endswith("no checkpoint (checkpointing disabled) (data.bad_rows = \"skip\" skips such rows)")


@pytest.mark.slow
def test_a_bad_row_in_the_first_batches_names_step_1(tmp_path):
    data = write_rows(tmp_path / "data.jsonl", 60, {2: b'{"text": 3}'})
    proc = run_train(["--job.dump_folder", str(tmp_path / "run"), *SMALL, "--data.path", str(data)],
                     script="tests/wrappers/train_unvalidated.py")
    assert error_line(proc) == f"error: step 1: {data}:2: field 'text' must be a string, got int"


def test_stream_state_counts_each_pass(tok, tmp_path, monkeypatch):
    # Unchecked data (over the limit) skips as it streams, with the same counts as checked data.
    data = bad_stream(tmp_path)
    checked = loader(tok, data, batch_size=4, bad_rows="skip")
    monkeypatch.setattr(trainer.data.loader, "VALIDATE_MAX_BYTES", 0)
    streamed = loader(tok, data, batch_size=4, bad_rows="skip")
    assert take(streamed, 30) == take(checked, 30)
    assert streamed.dataset.stats() == checked.dataset.stats()


@pytest.mark.slow
def test_checkpoint_from_before_bad_row_counting_resumes(tmp_path):
    # Checkpoints written before data.bad_rows existed have no bad_rows in the loader state.
    dump = tmp_path / "run"
    args = [*SMALL, "--job.dump_folder", str(dump), "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    ok(run_train([*args, "--training.steps", "2"]))
    extra_path = dump / "checkpoints" / "step-2" / "extra.json"
    extra = json.loads(extra_path.read_text())
    del extra["dataloader"]["dataset_state"]["bad_rows"]
    extra_path.write_text(json.dumps(extra))
    resumed = run_train([*args, "--training.steps", "3", "--checkpoint.verify_checksums", "false"])
    ok(resumed)
    assert "resumed from checkpoint at step 2" in resumed.stdout
    assert read_metrics(dump)[-1]["step"] == 3
