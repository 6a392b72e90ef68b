"""Weighted mixtures of sources ([[data.sources]]): shares per window, exact resume, per-source epochs.

The loaders run in this process (ranks as threads, one test over two gloo processes); the
training loop's use of them (startup summary, metrics keys) is covered by tests/trainer/metrics/test_wandb.py's run.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import ROOT, free_port
from tests.trainer.data.test_sharding import in_threads, take, write_docs
from trainer.config import SourceConfig, build_config
from trainer.data.loader import build_dataloader
from trainer.data.mixture import PERIOD, Schedule
from trainer.data.tokenizer import Tokenizer
from trainer.errors import UserError

TOKENIZER = str(ROOT / "data" / "tokenizer.model")
# The two shipped corpus files (0.9 MB each) as the two sources.
WEB, CODE = (str(ROOT / "data" / "corpus" / f"train-0000{i}.jsonl") for i in range(2))
SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(TOKENIZER)


def sources(web: str = WEB, code: str = CODE, weights: tuple[float, float] = (0.75, 0.25)) -> list[SourceConfig]:
    return [SourceConfig(path=web, weight=weights[0], name="web"), SourceConfig(path=code, weight=weights[1])]


def mixed(tok: Tokenizer, srcs: list[SourceConfig], *, batch_size: int = BATCH, dp_rank: int = 0, dp_degree: int = 1,
          **kw: Any):
    return build_dataloader(kind="pretrain", path="", tokenizer=tok, seq_len=SEQ_LEN, batch_size=batch_size,
                            dp_rank=dp_rank, dp_degree=dp_degree, seed=7, sources=srcs, **kw)


def test_token_shares_match_the_weights_in_every_window_of_50_steps(tok):
    dl = mixed(tok, sources())
    it = iter(dl)
    tokens, windows = [], []
    for _ in range(200):
        windows += next(it)["input_ids"].tolist()
        metrics = dl.dataset.metrics(dl.state_dict()["dataset_state"])
        tokens.append((metrics["data/tokens/web"], metrics["data/tokens/train-00001"]))
    for start in range(0, 151):
        web = tokens[start + 49][0] - (tokens[start - 1][0] if start else 0)
        code = tokens[start + 49][1] - (tokens[start - 1][1] if start else 0)
        assert abs(web / (web + code) - 0.75) <= 0.02, (start, web, code)
    assert tokens[-1] == (600 * SEQ_LEN, 200 * SEQ_LEN)
    # and window k is the next window of the source the schedule names, read as that source alone
    alone = [iter(build_dataloader(kind="pretrain", path=p, tokenizer=tok, seq_len=SEQ_LEN, batch_size=1, dp_rank=0,
                                   dp_degree=1, seed=0)) for p in (WEB, CODE)]
    schedule = dl.dataset.schedule
    assert windows == [next(alone[schedule.source(k)])["input_ids"][0].tolist() for k in range(800)]


def test_the_schedule_is_a_function_of_seed_and_window():
    a, again, b = (Schedule([3.0, 1.0], seed, ["a", "b"]) for seed in (7, 7, 8))
    assert [a.source(k) for k in range(5000)] == [again.source(k) for k in range(5000)]
    assert [a.source(k) for k in range(100)] != [b.source(k) for k in range(100)]
    # any run of windows, across the period's end too, holds each share within the stated tolerance
    s = Schedule([0.5, 0.3, 0.15, 0.05], 1, list("abcd"))
    picks = torch.tensor([s.source(k) for k in range(2 * PERIOD)])
    for src, share in enumerate(s.shares):
        counts = torch.cat([torch.zeros(1), (picks == src).cumsum(0).double()])
        for n in (7, 50, 400, 3000):
            spread = (counts[n:] - counts[:-n] - n * share).abs().max().item()
            assert spread <= s.tolerance, (src, n, spread, s.tolerance)
    assert s.tolerance < 2


def test_stopped_at_60_and_resumed_reads_the_same_batches_at_dp_1_and_2(tok):
    ref = take(mixed(tok, sources()), 100)
    first = mixed(tok, sources(), num_workers=1)
    take(first, 60)
    state = copy.deepcopy(first.state_dict())
    resumed = mixed(tok, sources(), num_workers=1)
    resumed.load_state_dict(copy.deepcopy(state))
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 40), ref[60:], strict=True))

    def rank(r: int, exchange) -> list[torch.Tensor]:
        dl = mixed(tok, sources(), batch_size=BATCH // 2, dp_rank=r, dp_degree=2, exchange=exchange)
        dl.load_state_dict(copy.deepcopy(state))
        return take(dl, 40)

    out = in_threads(2, rank)
    assert all(torch.equal(torch.cat([out[0][s], out[1][s]]), ref[60 + s]) for s in range(40))


def _gloo_rank(rank: int, port: int, state: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from trainer.data.exchange import world_exchange

    dl = mixed(Tokenizer(TOKENIZER), sources(), batch_size=BATCH // 2, dp_rank=rank, dp_degree=2,
               exchange=world_exchange())
    dl.load_state_dict(json.loads(Path(state).read_text()))
    Path(out, f"{rank}.json").write_text(json.dumps([b.tolist() for b in take(dl, 10)]))
    dist.barrier()  # gloo torn down under a peer's pending send aborts the peer
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.slow
def test_resumed_at_dp_2_over_gloo(tok, tmp_path):
    first = mixed(tok, sources())
    take(first, 60)
    (tmp_path / "state.json").write_text(json.dumps(first.state_dict()))
    ref = [b.tolist() for b in take(first, 10)]
    mp.spawn(_gloo_rank, args=(free_port(), str(tmp_path / "state.json"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [a + b for a, b in zip(*ranks)] == ref


def test_each_source_counts_its_own_epochs(tok, tmp_path):
    # a small source (glob) runs through many epochs while the large one is still in its first
    (tmp_path / "small").mkdir()
    small = write_docs(tmp_path / "small" / "part-1.jsonl", 12)
    per_epoch = sum(len(tok.encode(json.loads(line)["text"], True, True)) for line in small.read_text().splitlines())
    dl = mixed(tok, sources(code=str(tmp_path / "small" / "*.jsonl"), weights=(1, 1)))
    it = iter(dl)
    for _ in range(40):
        next(it)
        metrics = dl.dataset.metrics(dl.state_dict()["dataset_state"])
        # the next unused token of `small` is token `used` of its stream: epoch used // per_epoch
        used = metrics["data/tokens/small"] // SEQ_LEN * (SEQ_LEN + 1)
        assert metrics["data/epoch/small"] == used // per_epoch
        assert metrics["data/epoch/web"] == 0
    assert metrics["data/epoch/small"] >= 3


def test_sft_sets_mix(tok):
    from trainer.data.sft import SFTOptions

    srcs = [SourceConfig(path=str(ROOT / "data" / "sft" / "chat_example.jsonl"), weight=2, name="chat"),
            SourceConfig(path=str(ROOT / "data" / "sft" / "eval.jsonl"), weight=1, name="alpaca")]
    dl = build_dataloader(kind="sft", path="", tokenizer=tok, seq_len=256, batch_size=3, dp_rank=0, dp_degree=1,
                          seed=0, sft_options=SFTOptions(pack=True), sources=srcs)
    batches = take(dl, 4)
    assert all(b.shape == (3, 256) for b in batches)
    stats = dl.dataset.metrics(dl.state_dict()["dataset_state"])
    assert stats["data/samples"] > 0 and stats["data/tokens/chat"] > stats["data/tokens/alpaca"] > 0


@pytest.mark.parametrize(("toml", "message"), [
    ('path = "{web}"\nweight = 0', r"data\.sources\[0\] \(train-00000\): weight must be positive, got 0\.0"),
    ('path = "{web}"\nweight = -1\nname = "web"', r"data\.sources\[0\] \(web\): weight must be positive, got -1\.0"),
    ('path = "{web}"\nweight = 1\nname = "a"\n[[data.sources]]\npath = "{code}"\nweight = 1\nname = "a"',
     r"data\.sources\[1\] \(a\): name 'a' clashes with data\.sources\[0\]; give each source a distinct name"),
    ('path = "{web}"', r"data\.sources\[0\] in .*/c\.toml needs a weight"),
    ('path = "{web}"\nweight = 1\nwieght = 2', r"unknown key data\.sources\[0\]\.wieght \(did you mean 'weight'\?\)"),
])
def test_bad_sources_in_the_config_are_one_line(tmp_path, toml, message):
    (tmp_path / "c.toml").write_text("[[data.sources]]\n" + toml.format(web=WEB, code=CODE) + "\n")
    with pytest.raises(UserError, match=f"^{message}") as error:
        build_config(["--config", str(tmp_path / "c.toml")])
    assert "\n" not in str(error.value)


def test_missing_and_empty_sources_are_named(tok, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": " "}\n')
    for path, message in ((tmp_path / "nope.jsonl", r"data\.sources\[1\] \(nope\) not found: .*/nope\.jsonl"),
                          (tmp_path / "empty.jsonl", r"data\.sources\[1\] \(empty\) .*/empty\.jsonl is empty"),
                          (tmp_path / "blank.jsonl", r"data\.sources\[1\] \(blank\) .*/blank\.jsonl has no documents")):
        with pytest.raises(UserError, match=f"^{message}"):
            mixed(tok, [SourceConfig(path=WEB, weight=1), SourceConfig(path=str(path), weight=1)])
