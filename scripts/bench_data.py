"""Host time per step of the pretraining data loader at 1, 2 and 8 ranks, before and after sharding.

    git show 7a9870a:trainer/data/loader.py > /tmp/data_before.py        # the loader before sharding
    python scripts/bench_data.py --before /tmp/data_before.py     # ~5 min on 2 cores

Data settings of --config (default configs/7b_fp8.toml: seq_len 4096, batch_size 2 per rank,
data/corpus, data/tokenizer.model). For N ranks, rank 0 of N runs alone in this process, as
on a host with a core for each rank:

* before: the loader of --before, where every rank reads and tokenizes the whole stream;
* after: the sharded loader (trainer/data/loader.py) with 0, 1 and 2 worker processes. The other
  ranks' messages are recorded first (N ranks as threads) and replayed, so rank 0 does its
  own share of the tokenization and the whole merge; the gloo all-gather that the replay
  stands in for is timed on its own, with N processes on this host ("exchange").

Each step the training thread sleeps --step-ms (the device running the step: 590 ms is the
7B float8 step on H200s at this batch, docs/benchmarks.md), then takes the next batch.
"wait" is the wall time next() took (mean and worst over the measured steps), "training
thread CPU" the CPU time it used in next() (on a busy machine the wait also holds time the
thread waited for a core), "data CPU" the data loading CPU time per step of rank 0 with its
worker processes (over all steps, start and rows read ahead included), "docs" the documents
rank 0 tokenized per step (counted without workers). The exchange table gives the rounds per
step and the median wall time and the CPU time of a round's all-gather between N processes of
this host, and of an all-gather of one number (the latency floor of N processes on these
cores: with more processes than cores, wall time is mostly waiting to be scheduled).
Rank 0's batches are checked to be the same before and after. An earlier --out file moves to
previous-N/ beside it first.

--mixture instead: tokens/s of one rank's loader reading as fast as it can (no step sleep),
the files of data.path as one source against the same files as a weighted mixture
([[data.sources]], --weights), with each of --workers worker processes, --repeats times
interleaved (the median is reported: other jobs share the cores):

    python scripts/bench_data.py --mixture --workers 0,1 --steps 60     # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import build_config
from trainer.data.exchange import ThreadExchange, world_exchange
from trainer.data.loader import build_dataloader
from trainer.data.tokenizer import Tokenizer
from trainer.run_folder import keep_earlier_results

ROOT = Path(__file__).resolve().parents[1]


class CountingTokenizer(Tokenizer):
    """Counts the documents this process tokenizes."""

    calls = 0

    def encode(self, text: str, bos: bool, eos: bool) -> list[int]:
        self.calls += 1
        return super().encode(text, bos, eos)


class Recorder:
    """A rank's exchange that keeps every round's messages."""

    def __init__(self, member: Any, rounds: list[list[Any]]) -> None:
        self.member, self.rounds = member, rounds
        self.rank, self.size = member.rank, member.size

    def all_gather(self, message: Any) -> list[Any]:
        out = self.member.all_gather(message)
        self.rounds.append(out)
        return out


class Replay:
    """Rank 0's exchange, answered from a recording: the other ranks cost this process nothing."""

    rank = 0

    def __init__(self, rounds: list[list[Any]], size: int) -> None:
        self.rounds, self.size = iter(rounds), size

    def all_gather(self, message: Any) -> list[Any]:
        return [message, *next(self.rounds)[1:]]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(make: Callable[[], Any], steps: int, warmup: int, step_s: float) -> dict[str, Any]:
    loader = make()
    cpu, children = time.process_time(), children_cpu_s()
    it = iter(loader)
    waits, thread_cpu, batches = [], [], []
    for _ in range(warmup + steps):
        time.sleep(step_s)
        t, c = time.perf_counter(), time.thread_time()
        batch = next(it)
        waits.append(time.perf_counter() - t)
        thread_cpu.append(time.thread_time() - c)
        batches.append(batch["input_ids"])
    del it, loader  # joins the worker processes, so their CPU time is counted
    gc.collect()
    cpu = time.process_time() - cpu + children_cpu_s() - children
    return {"wait_ms": 1e3 * statistics.mean(waits[warmup:]), "wait_max_ms": 1e3 * max(waits[warmup:]),
            "thread_ms": 1e3 * statistics.mean(thread_cpu[warmup:]), "cpu_ms": 1e3 * cpu / (warmup + steps),
            "batches": batches}


def record(a: argparse.Namespace, kw: dict[str, Any], n: int) -> list[list[Any]]:
    """Rank 0's view of every exchange round of n ranks (as threads) over the benchmark's steps."""
    exchange = ThreadExchange(n)
    rounds: list[list[Any]] = []
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            member = exchange.member(r)
            loader = build_dataloader(**kw, dp_rank=r, dp_degree=n,
                                      exchange=Recorder(member, rounds) if r == 0 else member)
            it = iter(loader)
            for _ in range(a.warmup + a.steps):
                next(it)
        except BaseException as e:
            errors.append(e)
            exchange.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return rounds


def _gloo_rank(r: int, n: int, port: int, message: Any, rounds: int, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=n)
    exchange = world_exchange()
    one = [torch.zeros(1) for _ in range(n)]
    result = {}
    for name, gather in (("round", lambda: exchange.all_gather(message)),
                         ("floor", lambda: dist.all_gather(one, one[r], group=exchange.group))):
        times, cpu = [], 0.0
        for i in range(rounds + 3):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            gather()
            times.append(time.perf_counter() - t)
            cpu += (time.process_time() - c) * (i >= 3)
        result[f"{name}_ms"] = 1e3 * statistics.median(times[3:])
        result[f"{name}_cpu_ms"] = 1e3 * cpu / rounds
    if r == 0:
        out.put(result)
    dist.barrier()  # gloo torn down under a peer's pending send aborts the peer
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown (train.py does the same)


def gloo_exchange_ms(n: int, message: Any, rounds: int = 50) -> dict[str, float]:
    """Median wall time and mean CPU time (all threads of rank 0) of an exchange round between n
    processes of this host, each sending ``message`` (``round_*``), and of an all-gather of one
    number over the same group (``floor_*``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_gloo_rank, args=(n, port, message, rounds, out), nprocs=n, start_method="spawn")
    return out.get()


def tokens_per_s(make: Callable[[], Any], steps: int, warmup: int) -> float:
    """Tokens/s of a loader's batches after `warmup` ones (building it not timed)."""
    it = iter(make())
    for _ in range(warmup):
        batch = next(it)
    t = time.perf_counter()
    for _ in range(steps):
        batch = next(it)
    tokens = steps * batch["input_ids"].numel()
    del it
    gc.collect()  # joins the worker processes before the next loader starts its own
    return tokens / (time.perf_counter() - t)


def bench_mixture(a: argparse.Namespace, cfg: Any) -> list[dict[str, Any]]:
    from trainer.config import SourceConfig

    files = sorted(str(p) for p in Path(cfg.data.path).glob("*.jsonl"))
    weights = [float(w) for w in a.weights.split(",")]
    if len(files) != len(weights):
        raise SystemExit(f"{cfg.data.path} has {len(files)} .jsonl files, --weights gives {len(weights)} weights")
    sources = [SourceConfig(path=f, weight=w) for f, w in zip(files, weights)]
    tok = Tokenizer(cfg.model.tokenizer_path)
    kw = dict(kind="pretrain", path=cfg.data.path, tokenizer=tok, seq_len=cfg.training.seq_len,
              batch_size=cfg.training.batch_size, dp_rank=0, dp_degree=1, seed=0, text_field=cfg.data.text_field,
              data_format=cfg.data.format)
    rows = []
    for workers in [int(x) for x in a.workers.split(",")]:
        runs: dict[str, list[float]] = {"single source": [], f"mixture {a.weights}": []}
        for _ in range(a.repeats):
            for name in runs:
                extra = {"sources": sources} if name.startswith("mixture") else {}
                runs[name].append(tokens_per_s(
                    lambda extra=extra, workers=workers: build_dataloader(**kw, num_workers=workers, **extra),
                    a.steps, a.warmup))
        for name, rates in runs.items():
            rows.append({"loader": name, "workers": workers, "tokens_per_s": statistics.median(rates),
                         "all": [round(r) for r in rates]})
        print(f"{workers} workers done", flush=True)
    print("\n| loader | workers | tokens/s (median) | runs |")
    print("|---|--:|--:|---|")
    for r in rows:
        print(f"| {r['loader']} | {r['workers']} | {r['tokens_per_s']:,.0f} | {', '.join(f'{x:,}' for x in r['all'])} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", help="trainer/data/loader.py before sharding (git show 7a9870a:trainer/data/loader.py)")
    parser.add_argument("--mixture", action="store_true", help="time one source against a weighted mixture of its files")
    parser.add_argument("--weights", default="0.7,0.3", help="--mixture: a weight per .jsonl file of data.path")
    parser.add_argument("--repeats", type=int, default=3, help="--mixture: timings of each loader, interleaved")
    parser.add_argument("--config", default="configs/7b_fp8.toml")
    parser.add_argument("--ranks", default="1,2,8")
    parser.add_argument("--workers", default="0,1,2", help="worker processes per rank to time after sharding")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=590.0)
    parser.add_argument("--out", default="", help="also write the results as JSON here")
    a = parser.parse_args(argv)
    os.chdir(ROOT)
    cfg = build_config(["--config", a.config])
    out = Path(a.out) if a.out else None
    if out is not None:
        keep_earlier_results(out.parent, [out.name])
    if a.mixture:
        print(f"torch {torch.__version__}, {os.cpu_count()} cores; {a.config}: seq_len {cfg.training.seq_len}, "
              f"batch_size {cfg.training.batch_size}, data {cfg.data.path}", flush=True)
        rows = bench_mixture(a, cfg)
        if out is not None:
            out.write_text(json.dumps({"mixture": rows}, indent=1))
        return
    if a.before is None:
        parser.error("--before is required (or --mixture)")
    spec = importlib.util.spec_from_file_location("data_before", a.before)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    step_s = a.step_ms / 1e3
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores; {a.config}: seq_len {cfg.training.seq_len}, batch_size "
          f"{cfg.training.batch_size} per rank, data {cfg.data.path}; step {a.step_ms:.0f} ms", flush=True)

    rows, exchanges = [], []
    for n in [int(x) for x in a.ranks.split(",")]:
        tok = CountingTokenizer(cfg.model.tokenizer_path)
        kw = dict(kind="pretrain", path=cfg.data.path, tokenizer=tok, seq_len=cfg.training.seq_len,
                  batch_size=cfg.training.batch_size, seed=0, text_field=cfg.data.text_field,
                  data_format=cfg.data.format)
        steps = a.warmup + a.steps
        old = measure(lambda kw=kw, n=n: before.build_dataloader(**kw, dp_rank=0, dp_degree=n),
                      a.steps, a.warmup, step_s)
        rows.append({"ranks": n, "loader": "before", "docs": tok.calls / steps, **old})
        rounds = record(a, kw, n)
        per_step = (len(rounds) - 1) / steps  # the first round is the up-front check
        if n > 1:
            # a typical round: the entries rank 0 sent in its largest one
            share = max(rounds[1:], key=lambda m: len(m[0][0]))[0]
            exchanges.append({"ranks": n, "rounds_per_step": per_step, **gloo_exchange_ms(n, share)})
        for workers in [int(x) for x in a.workers.split(",")]:
            tok.calls = 0
            new = measure(lambda kw=kw, n=n, w=workers, rounds=rounds: build_dataloader(
                **kw, dp_rank=0, dp_degree=n, num_workers=w, exchange=Replay(rounds, n)), a.steps, a.warmup, step_s)
            same = all(torch.equal(x, y) for x, y in zip(new["batches"], old["batches"], strict=True))
            if not same:
                raise SystemExit(f"{n} ranks, {workers} workers: rank 0's batches differ from before")
            rows.append({"ranks": n, "loader": f"after, {workers} workers",
                         "docs": tok.calls / steps if workers == 0 else None, **new})
        print(f"{n} ranks done", flush=True)

    print("\n| ranks | loader | wait ms/step (mean / max) | training thread CPU ms/step | "
          "data CPU ms/step | docs tokenized/step |")
    print("|--:|---|--:|--:|--:|--:|")
    for r in rows:
        docs = f"{r['docs']:.0f}" if r["docs"] is not None else "-"
        print(f"| {r['ranks']} | {r['loader']} | {r['wait_ms']:.1f} / {r['wait_max_ms']:.1f} | "
              f"{r['thread_ms']:.1f} | {r['cpu_ms']:.1f} | {docs} |")
    print("\n| ranks | exchange rounds/step | round: wall ms / CPU ms | all-gather of one number: wall ms / CPU ms |")
    print("|--:|--:|--:|--:|")
    for e in exchanges:
        print(f"| {e['ranks']} | {e['rounds_per_step']:.2f} | {e['round_ms']:.2f} / {e['round_cpu_ms']:.2f} | "
              f"{e['floor_ms']:.2f} / {e['floor_cpu_ms']:.2f} |")
    if out is not None:
        results = [{k: v for k, v in r.items() if k != "batches"} for r in rows]
        out.write_text(json.dumps({"loaders": results, "exchange": exchanges}, indent=1))


if __name__ == "__main__":
    from trainer.cli import run_command

    sys.exit(run_command(main))
