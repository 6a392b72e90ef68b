"""scripts/gpu_check.py's runs: train.py and convert_weights.py as subprocesses, and one
function per group of checks that runs its row and judges it.

A Watch stops a run from outside: it kills a worker for the resume check and stops a run
that outlives --run-timeout. Groups share their runs through `state` (parity reads the
layouts rows' runs, the resume rows one reference run, sft-dcp sft-hf's weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from scripts.harness.cells import (
    cell_overrides,
    display_command,
    failure_reason,
    read_metrics,
    run_logged,
    summarize_metrics,
    train_launcher,
)
from scripts.harness.gpu_check.checks import (
    CKPT_STEP,
    SFT_LOSS_RTOL,
    WARMUP,
    check_records,
    parity_verdict,
    rel_diff,
    resume_verdict,
)
from scripts.harness.gpu_check.report import Row

_RESUMED = re.compile(r"resumed from checkpoint at step (\d+)")
_LOADED = re.compile(r"loaded initial weights \(\w+\) from .* in ([\d.]+)s; "
                     r"peak host memory per rank: ([\d., ]+) GiB")


def _children(pid: int) -> list[int]:
    """Child pids, from every thread's children file, else from the ppid field of /proc/*/stat."""
    kids: list[int] = []
    try:  # /proc/PID/task/TID/children needs CONFIG_PROC_CHILDREN
        files = list(Path(f"/proc/{pid}/task").glob("*/children"))
        if files:
            return [int(x) for f in files for x in f.read_text().split()]
    except OSError:
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                kids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def _train_children(pid: int) -> list[int]:
    found = []
    for kid in _children(pid):
        try:
            if b"train.py" in Path(f"/proc/{kid}/cmdline").read_bytes():
                found.append(kid)
        except OSError:
            continue
    return sorted(found)


def _last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text(errors="replace").splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps)


class Watch(threading.Thread):
    """Stops the running train.py: SIGKILL to one worker once checkpoints/step-K exists and
    metrics.jsonl is past step K (kill_after=K), or SIGTERM then SIGKILL at the timeout."""

    def __init__(self, dump: Path, nproc: int, timeout: float, kill_after: int | None) -> None:
        super().__init__(daemon=True)
        self.dump, self.nproc, self.timeout, self.kill_after = dump, nproc, timeout, kill_after
        self.done = threading.Event()
        self.killed: str | None = None
        self.timed_out = False

    def _signal(self, sig: int, worker: bool) -> str | None:
        launchers = _train_children(os.getpid())
        if not launchers:
            return None
        pid = launchers[0]
        if worker and self.nproc > 1:
            workers = _train_children(pid)
            if not workers:
                return None
            pid = workers[-1]  # the highest pid: not rank 0 as a rule
        os.kill(pid, sig)
        return f"pid {pid}"

    def run(self) -> None:
        start = time.monotonic()
        ckpt = None if self.kill_after is None else self.dump / "checkpoints" / f"step-{self.kill_after}"
        while not self.done.wait(0.02):
            if ckpt is not None and ckpt.is_dir():
                step = _last_step(self.dump / "metrics.jsonl")
                if step > self.kill_after and (who := self._signal(signal.SIGKILL, worker=True)):
                    self.killed = f"SIGKILL to {'worker ' if self.nproc > 1 else ''}{who} at step {step}"
                    return
            if time.monotonic() - start > self.timeout:
                self.timed_out = True
                self._signal(signal.SIGTERM, worker=False)
                if not self.done.wait(60):
                    self._signal(signal.SIGKILL, worker=False)
                return


@dataclasses.dataclass
class Run:
    """A finished subprocess: exit code, why it failed, its metrics records, log, command."""

    rc: int
    reason: str | None  # why it failed; None if it exited 0
    records: list[dict]
    log: str
    cmd: list[str]
    watch: Watch | None = None


def launch(cli: argparse.Namespace, row: Row, cmd: list[str], dump: Path, log: str = "log.txt",
           kill_after: int | None = None, steps: int | None = None) -> Run:
    """Run cmd (train.py when steps is given), logging to runs/<row>/<log>; fills nothing in row
    but its commands and wall time."""
    run_dir = cli.out / "runs" / row.name
    run_dir.mkdir(parents=True, exist_ok=True)
    row.commands.append(display_command(cmd))
    watch = Watch(dump, cli.nproc, cli.run_timeout, kill_after) if steps is not None else None
    if watch:
        watch.start()
    start = time.perf_counter()
    try:
        rc, tail = run_logged(cmd, run_dir / log)
    finally:
        if watch:
            watch.done.set()
            watch.join()
    row.wall_s += time.perf_counter() - start
    records: list[dict] = []
    reason = None if rc == 0 else failure_reason(tail, rc)
    if watch and watch.timed_out:
        reason = f"timed out after {cli.run_timeout:.0f} s (--run-timeout)"
    if steps is not None and reason is None:
        try:
            records = read_metrics(dump / "metrics.jsonl")
            reason = check_records(records, steps)
        except (ValueError, KeyError) as e:
            reason = f"unusable metrics: {e}"
    return Run(rc, reason, records, str(run_dir / log), cmd, watch)


def last_wins(args: list[str]) -> list[str]:
    """`--key value` pairs with each key once, holding its last value (train.py's rule too)."""
    pairs = dict(zip(args[::2], args[1::2]))  # a key keeps its first place, takes its last value
    return [x for pair in pairs.items() for x in pair]


def train_cmd(cli: argparse.Namespace, args: list[str], config: str = "configs/7b_fp8.toml") -> list[str]:
    """train.py on --nproc processes: the user's overrides after `--`, then the row's, which win."""
    return [*train_launcher(cli.nproc, "train.py"), "--config", config, *cli.extras, *last_wins(args)]


def cell_args(cli: argparse.Namespace, dump: Path, precision: str, compile_mode: str,
              layout: str = "fsdp", steps: int | None = None) -> list[str]:
    """A row's train.py options: the cell, the model and batch from the command line, the layout."""
    dp, tp = (cli.nproc, 1) if layout == "fsdp" else (1, cli.nproc)
    return [*cell_overrides(precision, compile_mode, steps or cli.steps, str(dump)),
            "--metrics.enable_tensorboard", "false", "--training.device", cli.device,
            "--model.flavor", cli.flavor, "--model.n_layers", str(cli.layers),
            "--training.batch_size", str(cli.batch_size * tp), "--training.seq_len", str(cli.seq_len),
            "--parallelism.data_parallel_shard_degree", str(dp),
            "--parallelism.tensor_parallel_degree", str(tp)]


def fill_metrics(row: Row, records: list[dict], warmup: int = WARMUP) -> None:
    """The row's tokens/s, peak memory and first-step time from its run's records."""
    s = summarize_metrics(records, warmup)
    row.tps, row.peak_gib, row.first_step_s = s["tps"], s["peak_memory_gib"], s["first_step_s"]


def run_cell(cli: argparse.Namespace, row: Row, extra: list[str], layout: str = "fsdp",
             steps: int | None = None, **kw: Any) -> Run:
    """A train.py run dumping to runs/<row>/; fails the row or fills its metrics."""
    dump = cli.out / "runs" / row.name
    steps = steps or cli.steps
    args = [*cell_args(cli, dump, row.precision, row.compile, layout, steps), *extra]
    run = launch(cli, row, train_cmd(cli, args, kw.pop("config", "configs/7b_fp8.toml")), dump,
                 steps=steps, **kw)
    if run.reason:
        row.fail(run.reason)
    else:
        fill_metrics(row, run.records, min(WARMUP, steps - 1))
        row.result = "pass"
    return run


# -- one function per group; `state` carries runs between rows -------------------------------------


def layout_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
    """One run of the row's layout, kept in `state` for the parity rows."""
    state[row.name] = run_cell(cli, row, [], row.name.partition("-")[0])


def parity_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
    """The layouts rows' FSDP and TP runs of this cell against each other; runs nothing."""
    fsdp, tp = (state[f"{k}-{row.precision}-{row.compile}"] for k in ("fsdp", "tp"))
    if fsdp.reason or tp.reason:
        row.fail("FSDP run failed" if fsdp.reason else "TP run failed")
        return
    ok, note = parity_verdict(fsdp.records, tp.records)
    row.notes.append(note)
    if ok:
        row.result = "pass"
    else:
        row.fail("FSDP and TP differ")


def ac_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
    """A run with the row's activation checkpointing mode, or (compile-model) whole-model compile."""
    mode = row.name.removeprefix("ac-")
    extra = [] if row.compile == "model" else ["--activation_checkpoint.mode", mode]
    row.notes.append(f"activation_checkpoint {mode}" if extra else "whole-model compile")
    run_cell(cli, row, extra)


def resume_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
    """Reference run (once), then a checkpointed run killed after step 3, then its rerun."""
    deterministic = ["--training.deterministic", "true"]
    if "resume_reference" not in state:
        ref = Row("resume-reference", "resume", row.layout, row.precision, row.compile)
        state["resume_reference"] = run_cell(cli, ref, deterministic, steps=cli.resume_steps)
        print(f"resume reference: {ref.result} {ref.reason}".rstrip() + f", {ref.wall_s:.0f} s", flush=True)
    reference = state["resume_reference"]
    if reference.reason:
        row.fail(f"reference run failed: {reference.reason}")
        return
    mode = row.name.removeprefix("resume-")
    row.notes.append(f"{mode} checkpoint")
    args = [*deterministic, "--checkpoint.enable", "true", "--checkpoint.interval", str(CKPT_STEP),
            "--checkpoint.async_mode", "async" if mode == "async" else "disabled"]
    first = run_cell(cli, row, args, steps=cli.resume_steps, kill_after=CKPT_STEP)
    if first.watch.killed is None:
        row.fail(first.reason or "the run finished before the kill")
        return
    row.notes.append(first.watch.killed)
    row.result, row.reason = "", ""  # the kill failed the row; the rerun decides
    dump = cli.out / "runs" / row.name
    again = launch(cli, row, first.cmd, dump, "log-resume.txt", steps=cli.resume_steps)
    if again.reason:
        row.fail(f"rerun: {again.reason}")
        return
    if not (m := _RESUMED.search(Path(again.log).read_text(errors="replace"))):
        row.fail("the rerun did not resume from a checkpoint")
        return
    ok, note = resume_verdict(reference.records, again.records, int(m.group(1)), cli.resume_steps)
    row.notes.append(f"resumed at step {m.group(1)}; {note}")
    fill_metrics(row, again.records)
    row.result = "pass"
    if not ok:
        row.fail("the resumed run differs from the reference")
    if not cli.keep_files:
        shutil.rmtree(dump / "checkpoints", ignore_errors=True)


def sft_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
    """sft-hf: random weights -> HF, SFT from them; sft-dcp: HF -> DCP, SFT, same step-1 loss."""
    fmt, w = row.name.removeprefix("sft-"), cli.out / "w"
    convert = [sys.executable, "scripts/convert_weights.py"]
    row.notes.append(f"{cli.sft_layers} layers{cli.sft_layers_note}")
    if fmt == "hf":
        convert += ["--from", "random", "--to", "hf", "--flavor", cli.flavor, "--dtype", "bf16",
                    "--n-layers", str(cli.sft_layers), "--device", cli.device, str(w / "hf")]
    elif not state.get("hf_weights"):
        row.fail("no HF weights (sft-hf's conversion failed or did not run)")
        return
    else:
        convert += ["--from", "hf", "--to", "dcp", str(w / "hf"), str(w / "dcp")]
    start = time.perf_counter()
    conv = launch(cli, row, convert, w, "log-convert.txt")
    if conv.reason:
        row.fail(f"convert: {conv.reason}")
        return
    state["hf_weights"] = True
    row.notes.append(f"convert {time.perf_counter() - start:.0f} s")
    args = ["--model.n_layers", str(cli.sft_layers), "--model.tokenizer_path", "data/tokenizer.model",
            "--checkpoint.initial_load_path", str(w / fmt), "--checkpoint.initial_load_format", fmt,
            "--checkpoint.enable", "false", "--checkpoint.export_final", "false"]
    run = run_cell(cli, row, args, steps=2, config="configs/7b_sft_fp8.toml")
    if run.reason:
        return
    if m := _LOADED.search(Path(run.log).read_text(errors="replace")):
        row.notes.append(f"load {m.group(1)} s; host peak per rank {m.group(2)} GiB")
    loss = state[f"sft_{fmt}_loss"] = run.records[0]["loss"]
    if fmt == "dcp" and "sft_hf_loss" in state:
        diff = rel_diff(loss, state["sft_hf_loss"])
        row.notes.append(f"step-1 loss {loss:.6f}, hf {state['sft_hf_loss']:.6f}: rel diff {diff:.1e}")
        if diff > SFT_LOSS_RTOL:
            row.fail("step-1 loss differs from sft-hf")
    if fmt == "dcp" and not cli.keep_files:
        shutil.rmtree(w, ignore_errors=True)


GROUP_RUNNERS = {"layouts": layout_row, "parity": parity_row, "ac": ac_row, "resume": resume_row,
                 "sft": sft_row}
