"""Pretraining data read once across the ranks: each rank tokenizes its share, in worker processes.

Ranks are threads of this process exchanging through ``ThreadExchange`` (one test uses two
gloo processes); the reference is one process reading alone, as every rank did before.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainer.data.loader
from tests.helpers import ROOT
from trainer.config import build_config
from trainer.data.exchange import ThreadExchange, world_exchange
from trainer.data.loader import build_dataloader
from trainer.data.sharding import BLOCK_ROWS, Block, Failure, merged_rows
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

TOKENIZER = str(ROOT / "data" / "tokenizer.model")
WORDS = ["red", "blue", "green", "old", "small", "happy", "brave", "quiet", "tall"]


class CountingTokenizer(Tokenizer):
    """Remembers the texts it encoded (in this process)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.texts: list[str] = []

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        self.texts.append(text)
        return super().encode(text, bos, eos)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TOKENIZER)


def doc(i: int) -> str:
    return f"Document {i}: the {WORDS[i % 9]} cat counted to {i * 7}. " * (1 + i % 5)


def write_docs(path: Path, n: int, bad: dict[int, str] | None = None) -> Path:
    """n JSON Lines rows, row k (0-based) replaced by bad[k]."""
    bad = bad or {}
    path.write_text("".join(bad.get(i, json.dumps({"text": doc(i)})) + "\n" for i in range(n)))
    return path


def loader(tokenizer: Tokenizer, path: Path, *, batch_size: int = 8, dp_rank: int = 0, dp_degree: int = 1,
           seq_len: int = 16, **kw: Any):
    return build_dataloader(kind="pretrain", path=str(path), tokenizer=tokenizer, seq_len=seq_len,
                            batch_size=batch_size, dp_rank=dp_rank, dp_degree=dp_degree, seed=0, **kw)


def take(dl, n: int) -> list[torch.Tensor]:
    it = iter(dl)
    return [next(it)["input_ids"] for _ in range(n)]


def in_threads(dp: int, body: Callable[[int, Any], Any]) -> list[Any]:
    """body(rank, exchange) on dp threads that exchange with each other; each one's result or exception."""
    exchange = ThreadExchange(dp, timeout_s=60)
    out: list[Any] = [None] * dp

    def run(rank: int) -> None:
        try:
            out[rank] = body(rank, exchange.member(rank))
        except BaseException as e:
            out[rank] = e
            if not isinstance(e, UserError):
                exchange.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def bad_data(tmp_path: Path) -> Path:
    # bad rows and rows without text between documents, first and last included
    return write_docs(tmp_path / "d.jsonl", 61, {0: "{oops", 9: '{"text": "  "}', 10: '{"body": 1}',
                                                 33: "[1]", 60: '{"text": null}'})


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sharded_ranks_read_the_single_reader_batches(tok, tmp_path, dp):
    data = bad_data(tmp_path)
    steps = 60  # more than two epochs
    single = loader(tok, data, bad_rows="skip")
    ref = take(single, steps)
    assert single.dataset.stats()["epoch"] >= 2

    def rank(r: int, exchange) -> tuple[list[torch.Tensor], dict]:
        dl = loader(tok, data, batch_size=8 // dp, dp_rank=r, dp_degree=dp, bad_rows="skip", exchange=exchange)
        return take(dl, steps), dl.state_dict()

    out = in_threads(dp, rank)
    for s in range(steps):
        assert torch.equal(torch.cat([batches[s] for batches, _ in out]), ref[s]), s
    # the state is global: the same on every rank, and the single reader's
    assert all(state == single.state_dict() for _, state in out)

    # and a state saved by the single reader mid-epoch resumes on the sharded ranks
    first = loader(tok, data, bad_rows="skip")
    take(first, 13)
    state = copy.deepcopy(first.state_dict())
    assert state["dataset_state"]["offset"] > 0

    def resumed(r: int, exchange) -> list[torch.Tensor]:
        dl = loader(tok, data, batch_size=8 // dp, dp_rank=r, dp_degree=dp, bad_rows="skip", exchange=exchange)
        dl.load_state_dict(copy.deepcopy(state))
        return take(dl, steps - 13)

    out = in_threads(dp, resumed)
    for s in range(steps - 13):
        assert torch.equal(torch.cat([batches[s] for batches in out]), ref[13 + s]), s


def test_each_rank_tokenizes_its_share(tok, tmp_path):
    data = write_docs(tmp_path / "d.jsonl", 1000)
    dp, steps = 4, 30
    tokenizers = [CountingTokenizer(TOKENIZER) for _ in range(dp)]

    def rank(r: int, exchange) -> dict:
        dl = loader(tokenizers[r], data, batch_size=2, seq_len=32, dp_rank=r, dp_degree=dp, exchange=exchange)
        take(dl, steps)
        return dl.state_dict()["dataset_state"]

    state = in_threads(dp, rank)[0]
    assert state["epoch"] == 0
    needed = state["doc"] + 1  # the documents the batches so far were cut from
    texts = [set(t.texts) for t in tokenizers]
    counts = [len(t.texts) for t in tokenizers]
    # every document was tokenized once in all, by the rank whose share it is ...
    assert sum(counts) == len(set().union(*texts))
    for r in range(dp):
        assert texts[r] <= {doc(i) for i in range(r, 1000, dp)}
    assert {doc(i) for i in range(needed)} <= set().union(*texts)
    # ... and no rank read far ahead: its quarter, plus the block it has started and a round
    group_rows = math.ceil(2 * dp * 33 / min(len(tok.encode(doc(i), True, True)) for i in range(5)))
    assert max(counts) <= math.ceil(needed / dp) + BLOCK_ROWS + group_rows, (counts, needed)
    assert 100 < needed < 250 and max(counts) < needed / 2  # a reader alone tokenizes all `needed`


def test_resume_with_workers_is_bitwise(tok, tmp_path):
    data = bad_data(tmp_path)
    steps = 30
    ref = take(loader(tok, data, bad_rows="skip", num_workers=2), steps)
    inline = loader(tok, data, bad_rows="skip")
    assert all(torch.equal(a, b) for a, b in zip(take(inline, steps), ref, strict=True))
    for k in (1, 7, 19):
        first = loader(tok, data, bad_rows="skip", num_workers=2)
        take(first, k)
        state = copy.deepcopy(first.state_dict())
        # what the training thread took, whatever the workers read ahead
        without = loader(tok, data, bad_rows="skip")
        take(without, k)
        assert state == without.state_dict()
        resumed = loader(tok, data, bad_rows="skip", num_workers=2)
        resumed.load_state_dict(state)
        assert all(torch.equal(a, b) for a, b in zip(take(resumed, steps - k), ref[k:], strict=True)), k
        assert resumed.dataset.stats() == inline.dataset.stats()


def test_a_bad_row_stops_every_rank_at_the_same_batch(tok, tmp_path, monkeypatch):
    # unchecked data: the row is met as the stream reaches it; row 21 is rank 1's to read
    monkeypatch.setattr(trainer.data.loader, "VALIDATE_MAX_BYTES", 0)
    data = write_docs(tmp_path / "d.jsonl", 60, {21: '{"text": 3}'})

    def rank(r: int, exchange) -> tuple[int, str]:
        it = iter(loader(tok, data, batch_size=2, dp_rank=r, dp_degree=2, exchange=exchange))
        for n in range(100):
            try:
                next(it)
            except UserError as e:
                return n, str(e)
        raise AssertionError("no error")

    out = in_threads(2, rank)
    assert out[0] == out[1] and out[0][0] > 0
    assert out[0][1] == f"{data}:22: field 'text' must be a string, got int"


def test_what_a_worker_cannot_read_is_one_line(tok, tmp_path, monkeypatch):
    # not DataLoader's multi-line "Caught UserError in DataLoader worker process 0 ..."
    monkeypatch.setattr(trainer.data.loader, "VALIDATE_MAX_BYTES", 0)
    data = write_docs(tmp_path / "d.jsonl", 60, {21: "{oops"})
    it = iter(loader(tok, data, num_workers=2))
    with pytest.raises(UserError, match=rf"^{re.escape(str(data))}:22: not valid JSON \(JSONDecodeError: [^\n]*\)$"):
        for _ in range(100):
            next(it)
    broken = tmp_path / "d.json"
    broken.write_text('[{"text": "a b c"}, oops]')
    with pytest.raises(UserError, match=rf"^{re.escape(str(broken))}: not valid JSON \(JSONDecodeError: [^\n]*\)$"):
        next(iter(loader(tok, broken, num_workers=1)))


def test_the_up_front_check_is_shared(tok, tmp_path, capsys):
    data = write_docs(tmp_path / "d.jsonl", 40, {30: "{oops", 11: '{"body": 1}'})  # rank 0's, then rank 1's

    def rank(r: int, exchange) -> Any:
        return loader(tok, data, dp_rank=r, dp_degree=2, batch_size=4, exchange=exchange)

    errors = in_threads(2, rank)
    assert [str(e) for e in errors] == [f"{data}:12: missing field 'text' (fields: body)"] * 2

    def skipping(r: int, exchange) -> Any:
        return loader(tok, data, dp_rank=r, dp_degree=2, batch_size=4, exchange=exchange, bad_rows="skip",
                      verbose=r == 0)

    in_threads(2, skipping)
    assert capsys.readouterr().err == (
        f"warning: skipping 2 bad rows of data {data} (data.bad_rows = 'skip'; counted as data/bad_rows), "
        f"the first: {data}:12: missing field 'text' (fields: body)\n")


def test_a_read_failure_on_one_rank_stops_all():
    def rank(r: int, exchange) -> Any:
        share = Block(0, r, [None] * BLOCK_ROWS, None) if r == 0 else Failure("data.jsonl: broken pipe")
        return list(merged_rows(iter([share]), exchange, epoch=0, start=0, round_tokens=100))

    assert [str(e) for e in in_threads(2, rank)] == ["data.jsonl: broken pipe"] * 2


def test_num_workers_is_checked(tok, tmp_path):
    with pytest.raises(UserError, match=r"^data\.num_workers must be >= 0, got -1$"):
        build_config(["--data.num_workers", "-1"])
    with pytest.raises(UserError, match=r"^num_workers must be >= 0, got -1$"):
        loader(tok, write_docs(tmp_path / "d.jsonl", 3), num_workers=-1)


# -- two gloo processes -----------------------------------------------------------------------


def _gloo_rank(rank: int, port: int, data: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tokenizer = CountingTokenizer(TOKENIZER)
    dl = loader(tokenizer, Path(data), batch_size=4, dp_rank=rank, dp_degree=2, exchange=world_exchange())
    batches = [b.tolist() for b in take(dl, 12)]
    Path(out, f"{rank}.json").write_text(json.dumps({"batches": batches, "tokenized": len(tokenizer.texts),
                                                     "state": dl.state_dict()["dataset_state"]}))
    dist.barrier()  # gloo torn down under a peer's pending send aborts the peer
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_ranks_of_a_run_share_the_reading_over_gloo(tok, tmp_path):
    data = write_docs(tmp_path / "d.jsonl", 400)
    single = loader(CountingTokenizer(TOKENIZER), data)
    ref = [b.tolist() for b in take(single, 12)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(port, str(data), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [a + b for a, b in zip(ranks[0]["batches"], ranks[1]["batches"])] == ref
    assert ranks[0]["state"] == ranks[1]["state"] == single.state_dict()["dataset_state"]
    needed = single.dataset.stats()["doc"] + 1
    assert all(r["tokenized"] <= needed / 2 + BLOCK_ROWS + 8 for r in ranks), (needed, ranks)
