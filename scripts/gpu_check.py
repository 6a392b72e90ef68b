"""GPU acceptance check: short real train.py runs, one pass/fail table.

    python scripts/gpu_check.py --nproc 2 --out /tmp/gpu_check                     # every group
    python scripts/gpu_check.py --nproc 1 --out /tmp/gc1 --only layouts,parity,ac  # 1 H200: 4 min
    python scripts/gpu_check.py --nproc 1 --out /tmp/gc2 --only resume,sft         # 1 H200: 5 min
    python scripts/gpu_check.py --device cpu --flavor debug --nproc 2 --out /tmp/gc \\
        --only layouts,parity,resume --precisions bf16,tensorwise --compile none   # CPU smoke test

Groups (--only; default all):
  layouts  FSDP (dp = nproc) and TP (tp = nproc, batch x nproc: same global batch and tokens per
           GPU) x precision (bf16, tensorwise, rowwise, rowwise_gw_hp) x compile (none, block)
  parity   loss and grad_norm of steps 1-3 agree between the FSDP and TP rows (runs them)
  ac       activation checkpointing full and selective, and compile.mode model (tensorwise, FSDP)
  resume   kill one worker (SIGKILL) after the step-3 checkpoint, rerun: steps 4.. must equal an
           uninterrupted deterministic run bitwise; sync and async checkpoints
  sft      random 7B -> HF (convert_weights.py --from random) -> DCP; SFT from each; step-1 losses
Base config configs/7b_fp8.toml (sft: configs/7b_sft_fp8.toml) with --layers layers; arguments
after `--` go to every train.py run. Rows needing more GPUs than --nproc are skipped. Writes, under
--out: gpu_check.md, gpu_check.json, runs/<row>/log.txt (other runs of a row: log-<phase>.txt) and
each run's dump folder. The table comes last on stdout; exit code 0 iff no row that ran failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_throughput as ct  # also puts the repository on sys.path

from models.llama import LLAMA2_FLAVORS

ROOT = ct.ROOT
GROUPS = ("layouts", "parity", "ac", "resume", "sft")
WARMUP = 2  # steps dropped from the medians
# FSDP and TP reduce in different orders and TP computes norms and the loss over sharded
# tensors, all in bf16 compute: over the first steps the two agree to ~1e-3; the bounds leave
# room for float8 scales, which see those differences too. grad_norm is the more sensitive.
PARITY_RTOL = {"loss": 2e-2, "grad_norm": 5e-2}
PARITY_STEPS = 3
CKPT_STEP = 3  # resume: checkpoint interval, and the step the rerun resumes from
# A deterministic rerun should be bitwise equal; compiled kernels picked by autotuning may
# not be, so a difference up to this (relative) passes as "not bitwise".
RESUME_RTOL = 1e-3
# The DCP weights are the HF bf16 weights re-saved: step 1 (forward before any update) matches.
SFT_LOSS_RTOL = 1e-3
_RESUMED = re.compile(r"resumed from checkpoint at step (\d+)")
_LOADED = re.compile(r"loaded initial weights \(\w+\) from .* in ([\d.]+)s; "
                     r"peak host memory per rank: ([\d., ]+) GiB")


@dataclasses.dataclass
class Row:
    name: str
    group: str
    layout: str
    precision: str
    compile: str
    needs: int = 1  # processes (GPUs)
    result: str = ""  # pass | FAIL | skipped
    reason: str = ""
    tps: float | None = None
    peak_gib: float | None = None
    first_step_s: float | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    commands: list[str] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0

    def fail(self, reason: str) -> Row:
        self.result, self.reason = "FAIL", reason
        return self


# -- pure helpers (unit-tested) ------------------------------------------------------------------


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def max_rel_diffs(a: list[dict], b: list[dict], steps: range) -> tuple[dict[str, float], list[int]]:
    """Max relative difference of loss and grad_norm over `steps`, and the steps either lacks."""
    by_a, by_b = ({r["step"]: r for r in rows} for rows in (a, b))
    missing = [s for s in steps if s not in by_a or s not in by_b]
    diffs = {key: max((rel_diff(by_a[s][key], by_b[s][key]) for s in steps if s not in missing),
                      default=0.0) for key in ("loss", "grad_norm")}
    return diffs, missing


def _diffs_text(diffs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())


def parity_verdict(fsdp: list[dict], tp: list[dict]) -> tuple[bool, str]:
    diffs, missing = max_rel_diffs(fsdp, tp, range(1, PARITY_STEPS + 1))
    if missing:
        return False, f"steps {missing} missing"
    ok = all(diffs[k] <= PARITY_RTOL[k] for k in diffs)
    return ok, f"max rel diff steps 1-{PARITY_STEPS}: {_diffs_text(diffs)}"


def resume_verdict(reference: list[dict], resumed: list[dict], after: int, last: int) -> tuple[bool, str]:
    """Steps after..last of the resumed run against the uninterrupted reference."""
    steps = range(after + 1, last + 1)
    if not steps:
        return False, f"resumed at step {after}: no steps left to compare"
    diffs, missing = max_rel_diffs(reference, resumed, steps)
    span = f"steps {after + 1}-{last}"
    if missing:
        return False, f"{span}: steps {missing} missing"
    if not any(diffs.values()):
        return True, f"{span} bitwise equal to the reference"
    ok = max(diffs.values()) <= RESUME_RTOL
    return ok, f"{span} not bitwise: max rel diff {_diffs_text(diffs)}"


def check_records(records: list[dict], steps: int) -> str | None:
    """Why a run's metrics are not a pass (None if they are)."""
    last = max((r["step"] for r in records), default=0)
    if last != steps:
        return f"metrics end at step {last} of {steps}"
    bad = [r["step"] for r in records if not math.isfinite(r["loss"])]
    return f"non-finite loss at steps {bad}" if bad else None


def skip_rows(rows: list[Row], nproc: int, unit: str = "GPUs") -> None:
    for row in rows:
        if row.needs > nproc:
            row.result, row.reason = "skipped", f"needs {row.needs} {unit}"


HEADER = ("| row | layout | precision | compile | result | tokens/s/GPU | peak mem GiB | first-step s "
          "| notes |\n|---|---|---|---|---|--:|--:|--:|---|")


def render_table(rows: list[Row]) -> str:
    lines = [HEADER]
    for r in rows:
        result = r.result or "not run"
        if r.result == "skipped":
            result = f"skipped ({r.reason})"
        elif r.reason:
            result += f": {r.reason}"
        cells = [r.name, r.layout, r.precision, r.compile, result.replace("|", "/"),
                 *("" if x is None else ct._num(x) for x in (r.tps, r.peak_gib, r.first_step_s)),
                 "; ".join(r.notes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(rows: list[Row], info: dict[str, Any]) -> str:
    env = info["environment"]
    device = env["gpu"] or f"CPU ({env['cpu']})"
    return "\n".join([
        "# GPU acceptance check", "", render_table(rows), "",
        f"Medians over steps {WARMUP + 1}.. ({WARMUP} warm-up steps dropped); first-step s includes "
        "compilation; peak mem: peak active CUDA memory (CPU: peak RSS).", "",
        f"- command: `{info['command']}`",
        f"- date: {info['date']}",
        f"- device: {device} x {info['nproc']}",
        f"- torch {env['torch']}" + (f", CUDA {env['cuda']}" if env["cuda"] else "")
        + f", python {env['python']}",
    ]) + "\n"


# -- running train.py ------------------------------------------------------------------------------


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
    row.commands.append(ct._display(cmd))
    watch = Watch(dump, cli.nproc, cli.run_timeout, kill_after) if steps is not None else None
    if watch:
        watch.start()
    start = time.perf_counter()
    try:
        rc, tail = ct._stream(cmd, run_dir / log)
    finally:
        if watch:
            watch.done.set()
            watch.join()
    row.wall_s += time.perf_counter() - start
    records: list[dict] = []
    reason = None if rc == 0 else ct.failure_reason(tail, rc)
    if watch and watch.timed_out:
        reason = f"timed out after {cli.run_timeout:.0f} s (--run-timeout)"
    if steps is not None and reason is None:
        try:
            records = ct._read_metrics(dump / "metrics.jsonl")
            reason = check_records(records, steps)
        except (ValueError, KeyError) as e:
            reason = f"unusable metrics: {e}"
    return Run(rc, reason, records, str(run_dir / log), cmd, watch)


def last_wins(args: list[str]) -> list[str]:
    """`--key value` pairs with each key once, holding its last value (train.py's rule too)."""
    pairs = dict(zip(args[::2], args[1::2]))  # a key keeps its first place, takes its last value
    return [x for pair in pairs.items() for x in pair]


def train_cmd(cli: argparse.Namespace, args: list[str], config: str = "configs/7b_fp8.toml") -> list[str]:
    return [*ct._launcher(cli.nproc, "train.py"), "--config", config, *cli.extras, *last_wins(args)]


def cell_args(cli: argparse.Namespace, dump: Path, precision: str, compile_mode: str,
              layout: str = "fsdp", steps: int | None = None) -> list[str]:
    dp, tp = (cli.nproc, 1) if layout == "fsdp" else (1, cli.nproc)
    return [*ct.cell_overrides(precision, compile_mode, steps or cli.steps, str(dump)),
            "--metrics.enable_tensorboard", "false", "--training.device", cli.device,
            "--model.flavor", cli.flavor, "--model.n_layers", str(cli.layers),
            "--training.batch_size", str(cli.batch_size * tp), "--training.seq_len", str(cli.seq_len),
            "--parallelism.data_parallel_shard_degree", str(dp),
            "--parallelism.tensor_parallel_degree", str(tp)]


def fill_metrics(row: Row, records: list[dict], warmup: int = WARMUP) -> None:
    s = ct.summarize(records, warmup)
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
    state[row.name] = run_cell(cli, row, [], row.name.partition("-")[0])


def parity_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
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
    mode = row.name.removeprefix("ac-")
    extra = [] if row.compile == "model" else ["--activation_checkpoint.mode", mode]
    row.notes.append(f"activation_checkpoint {mode}" if extra else "whole-model compile")
    run_cell(cli, row, extra)


def resume_row(cli: argparse.Namespace, row: Row, state: dict[str, Any]) -> None:
    """Reference run (once), then a checkpointed run killed after step 3, then its rerun."""
    deterministic = ["--training.deterministic", "true"]
    if "resume_reference" not in state:
        ref = Row("resume-reference", "resume", row.layout, row.precision, row.compile)
        shutil.rmtree(cli.out / "runs" / ref.name, ignore_errors=True)
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
        shutil.rmtree(w, ignore_errors=True)
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


def build_rows(cli: argparse.Namespace, groups: list[str]) -> list[Row]:
    n, tp = cli.nproc, max(cli.nproc, 2)
    cells = [(p, c) for c in cli.compile for p in cli.precisions]
    compile_mode = "block" if "block" in cli.compile else cli.compile[-1]
    fsdp = f"FSDP {n}"

    def tensorwise(group: str, *names: str) -> list[Row]:
        return [Row(name, group, fsdp, "tensorwise", compile_mode) for name in names]

    rows = {
        "layouts": [Row(f"fsdp-{p}-{c}", "layouts", fsdp, p, c) for p, c in cells]
        + [Row(f"tp-{p}-{c}", "layouts", f"TP {tp}", p, c, needs=2) for p, c in cells],
        "parity": [Row(f"parity-{p}-{c}", "parity", f"FSDP {tp} vs TP {tp}", p, c, needs=2)
                   for p, c in cells],
        "ac": [*tensorwise("ac", "ac-full", "ac-selective"),
               Row("compile-model", "ac", fsdp, "tensorwise", "model")],
        "resume": tensorwise("resume", "resume-sync", "resume-async"),
        "sft": tensorwise("sft", "sft-hf", "sft-dcp"),
    }
    wanted = set(groups)
    if "parity" in wanted and n >= 2:
        wanted.add("layouts")  # parity compares the layouts rows' runs
    return [row for group in GROUPS if group in wanted for row in rows[group]]


def run_all(cli: argparse.Namespace, table: list[Row]) -> dict[str, Any]:
    """Run the rows in table order, printing a line as each one finishes."""
    skip_rows(table, cli.nproc, "GPUs" if cli.device == "cuda" else "processes")
    state: dict[str, Any] = {}
    for i, row in enumerate(table, 1):
        if row.result != "skipped":
            shutil.rmtree(cli.out / "runs" / row.name, ignore_errors=True)
            GROUP_RUNNERS[row.group](cli, row, state)
        text = row.result + (f" ({row.reason})" if row.reason else "")
        print(f"[{i}/{len(table)}] {row.name}: {text}, {row.wall_s:.0f} s", flush=True)
    ref = state.get("resume_reference")
    return {"resume_reference": {"command": ct._display(ref.cmd), "log": ref.log,
                                 "reason": ref.reason}} if ref else {}


# -- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options, with train.py overrides after `--` in .extras; raises ct._BadArgs."""
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extras = argv[:cut], argv[cut + 1:]
    p = ct._Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run (default 1)")
    p.add_argument("--only", default=",".join(GROUPS), help="comma list of groups (default: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--flavor", choices=sorted(LLAMA2_FLAVORS), default="7B")
    p.add_argument("--layers", type=int, default=2, help="model.n_layers of the short runs (default 2)")
    p.add_argument("--steps", type=int, default=6, help=f"steps per run (default 6; {WARMUP} warm-up)")
    p.add_argument("--resume-steps", type=int, default=6, help="steps of the kill/resume runs (default 6)")
    p.add_argument("--batch-size", type=int, help="per FSDP rank (default 2)")
    p.add_argument("--seq-len", type=int, help="default 4096 (debug flavor: 128)")
    p.add_argument("--precisions", default=",".join(ct.PRECISIONS), help="layouts/parity precisions")
    p.add_argument("--compile", default="none,block", help="layouts/parity compile modes; the other "
                   "rows use block, or the last of these if block is left out")
    p.add_argument("--sft-layers", type=int, help="SFT depth (default: the flavor's with --nproc >= 2, "
                   "else at most 8)")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds per train.py run (default 900)")
    p.add_argument("--keep-files", action="store_true", help="keep checkpoints and converted weights")
    cli = p.parse_args(argv)
    cli.extras = extras
    cli.groups = ct._names(cli.only, GROUPS, "--only")
    cli.precisions = ct._names(cli.precisions, ct.PRECISIONS, "--precisions")
    cli.compile = ct._names(cli.compile, ct.COMPILE_MODES, "--compile")
    if cli.nproc < 1:
        raise ct._BadArgs(f"--nproc must be >= 1, got {cli.nproc}")
    if cli.steps <= max(WARMUP, PARITY_STEPS):
        raise ct._BadArgs(f"--steps must be > {max(WARMUP, PARITY_STEPS)}, got {cli.steps}")
    if cli.resume_steps <= CKPT_STEP:
        raise ct._BadArgs(f"--resume-steps must be > {CKPT_STEP}, got {cli.resume_steps}")
    debug = cli.flavor == "debug"
    cli.batch_size = cli.batch_size or 2
    cli.seq_len = cli.seq_len or (128 if debug else 4096)
    full = LLAMA2_FLAVORS[cli.flavor].n_layers
    cli.sft_layers_note = ""
    if cli.sft_layers is None:
        cli.sft_layers = full if cli.nproc >= 2 else min(full, 8)
        if cli.sft_layers < full:
            # The SFT config (batch 2 x 4096, selective AC) is sized for several GPUs.
            cli.sft_layers_note = f" of {full} on one GPU (--sft-layers {full} for all)"
    cli.out = cli.out.resolve()
    owned = set(ct._option_names(cell_args(cli, Path("x"), "rowwise", "none"))) | {
        "config", "training.deterministic", "checkpoint.enable", "checkpoint.interval",
        "checkpoint.async_mode", "checkpoint.initial_load_path", "checkpoint.initial_load_format",
        "checkpoint.export_final", "activation_checkpoint.mode", "model.tokenizer_path"}
    for name in ct._option_names(extras):
        if name in owned - {"float8.fsdp_float8_all_gather"}:
            raise ct._BadArgs(f"--{name} after `--` is set by this script for each row")
    return cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli = parse_args(argv)
    except ct._BadArgs as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    os.chdir(ROOT)  # the configs name data/ and the tokenizer relative to the repository
    cli.out.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    table = build_rows(cli, cli.groups)
    extra_info = run_all(cli, table)
    info = {"command": shlex.join(["python", "scripts/gpu_check.py", *argv]), "date": date,
            "nproc": cli.nproc, "environment": ct.environment()}
    ok = all(r.result in ("pass", "skipped") for r in table)
    report = {**info, "passed": ok, "groups": cli.groups, "flavor": cli.flavor, "layers": cli.layers,
              "steps": cli.steps, "resume_steps": cli.resume_steps, "batch_size": cli.batch_size,
              "seq_len": cli.seq_len, "sft_layers": cli.sft_layers, "train_overrides": cli.extras,
              **extra_info, "rows": [dataclasses.asdict(r) for r in table]}
    (cli.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (cli.out / "gpu_check.md").write_text(render_markdown(table, info))
    print(f"wrote {cli.out / 'gpu_check.md'}, {cli.out / 'gpu_check.json'}; "
          f"{'all rows passed' if ok else 'FAILED'}", flush=True)
    print(render_table(table), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
