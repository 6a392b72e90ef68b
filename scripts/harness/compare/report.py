"""The comparison's result files: speedups, comparison.md tables, comparison.json written and read back."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from scripts.harness.arguments import load_json_file
from scripts.harness.cells import BASELINE, COMPILE_MODES, DEFAULT_IMPL, IMPLS, PRECISIONS
from scripts.harness.compare.run import CellResult
from scripts.harness.traces import CLASSES


class ResultFileError(Exception):
    """A comparison.json that is missing, unreadable or not a comparison."""


@dataclasses.dataclass
class Run:
    """The cells of one comparison.json and what it says about how they were run."""

    path: Path
    results: list[CellResult]
    info: dict[str, Any]


def add_speedups(results: list[CellResult]) -> None:
    """Tokens/s relative to bf16 eager and to bf16 under the same compile mode (None if missing)."""
    bf16 = {r.compile: r.tps for r in results if r.ok and r.precision == BASELINE}
    for r in results:
        if not r.ok:
            continue
        eager, same = bf16.get("none"), bf16.get(r.compile)
        r.speedup_vs_bf16_eager = r.tps / eager if eager else None
        r.speedup_vs_bf16_same_compile = r.tps / same if same else None


def format_number(x: float) -> str:
    """x for a table cell: whole with thousands separators from 100, two decimals from 1, else 3 digits."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _opt(x: float | None, fmt: Any = format_number) -> str:
    return "n/a" if x is None else fmt(x)


def speedup_text(x: float) -> str:
    return f"{x:.2f}x"


TABLE_HEADER = (
    "| precision | compile | tokens/s/GPU | TFLOP/s/GPU | MFU % | peak mem GiB | first step s "
    "| final loss | vs bf16 eager | vs bf16 same compile |\n"
    "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|"
)


def render_table(results: list[CellResult]) -> str:
    rows = [TABLE_HEADER]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.label} | {r.compile} | failed | | | | | | | |")
            continue
        rows.append(
            f"| {r.label} | {r.compile} | {r.tps:,.0f} | {format_number(r.tflops)} | {_opt(r.mfu_pct)} "
            f"| {format_number(r.peak_memory_gib)} | {_opt(r.first_step_s)} | {r.final_loss:.4f} "
            f"| {_opt(r.speedup_vs_bf16_eager, speedup_text)} | {_opt(r.speedup_vs_bf16_same_compile, speedup_text)} |"
        )
    return "\n".join(rows)


def render_failures(results: list[CellResult]) -> str:
    failed = [r for r in results if not r.ok]
    if not failed:
        return ""
    return "Failed cells:\n" + "\n".join(f"- {r.name}: {r.reason} (log: {r.log})" for r in failed)


_PROFILE_EXTRAS = (("nccl_not_overlapped_ms", "NCCL not overlapped"), ("gpu_idle_ms", "GPU idle"),
                   ("step_wall_ms", "step wall"))


def render_profiles(results: list[CellResult], step: int) -> str:
    """One row per cell: ms (count) per kernel class of the profiled step, then overlap and idle."""
    labels = [*CLASSES.values(), *(label for _, label in _PROFILE_EXTRAS)]
    rows = [
        f"Profile of step {step}, rank 0 (`python scripts/profile_summary.py "
        f"runs/<cell>/profiles/step-{step}/rank-0.json`): device time in ms (kernels) by class; "
        "on a CPU run, the self time of CPU ops (ops), without NCCL overlap or GPU idle.",
        "",
        "| precision | compile | " + " | ".join(labels) + " |",
        "|---|---|" + "--:|" * len(labels),
    ]
    for r in results:
        if r.profile is None:
            continue
        if "error" in r.profile:
            rows.append(f"| {r.label} | {r.compile} | no trace: {r.profile['error']} |" + " |" * (len(labels) - 1))
            continue
        cells = [f"{c['ms']:.2f} ({c['count']})" for c in r.profile["classes"].values()]
        cells += ["-" if key not in r.profile else f"{r.profile[key]:.2f}" for key, _ in _PROFILE_EXTRAS]
        rows.append(f"| {r.label} | {r.compile} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def render_markdown(results: list[CellResult], info: dict[str, Any]) -> str:
    steps, warmup = info["steps"], info["warmup"]
    env = info["environment"]
    device = env["gpu"] or f"CPU ({env['cpu']})"
    memory = "peak active CUDA memory" if env["gpu"] else "process peak RSS (CPU run)"
    profile_step = info.get("profile_step")
    parts = ["# Throughput: bf16 vs float8, eager vs compiled", "", render_table(results), ""]
    if failures := render_failures(results):
        parts += [failures, ""]
    parts += [
        f"Medians over steps {warmup + 1}-{steps} of {steps} ({warmup} warm-up steps dropped"
        + (f"; profiled step {profile_step} and the step after it left out" if profile_step else "") + "); "
        f"first step s includes compilation; peak mem is the max over all steps of the {memory}; "
        "MFU is against the GPU's bf16 dense peak (n/a on CPU)."
        + ("" if all(r.impl == DEFAULT_IMPL for r in results) else " A precision named `<recipe>-torchao` ran "
           "the recipe on the reference library torchao.float8 (float8.impl = torchao), the others on ours.")
        + ("" if env["gpu"] else " On a CPU without native bf16 the bf16 cells compute in float32 "
           "(training.mixed_precision_param = auto)."),
        "",
    ]
    if profile_step:
        parts += [render_profiles(results, profile_step), ""]
    parts += [
        f"- command: `{info['command']}`",
        f"- date: {info['date']}",
        f"- torch {env['torch']}" + (f", CUDA {env['cuda']}" if env["cuda"] else "") + f", python {env['python']}"
        + (f", torchao {info['torchao']}" if info.get("torchao") else ""),
        f"- device: {device} x {info['nproc']} process(es)",
    ]
    return "\n".join(parts) + "\n"


def report_json(results: list[CellResult], info: dict[str, Any]) -> dict[str, Any]:
    """comparison.json: the run's info and every cell, failures by name."""
    return {
        **info,
        "baseline": f"{BASELINE}-none",
        "cells": [{"name": r.name, **dataclasses.asdict(r)} for r in results],
        "failures": {r.name: r.reason for r in results if not r.ok},
    }


_CELL_FIELDS = {f.name for f in dataclasses.fields(CellResult)}


def load_run(path: Path) -> Run:
    """A comparison.json written by report_json; raises ResultFileError with a one-line reason."""
    data = load_json_file(path, ResultFileError)
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list) or not all(
        isinstance(c, dict) and c.get("precision") in PRECISIONS and c.get("compile") in COMPILE_MODES
        and c.get("impl", DEFAULT_IMPL) in IMPLS and isinstance(c.get("ok"), bool) for c in cells
    ):
        raise ResultFileError(f"{path}: not a comparison.json (no list of cells with precision, compile, ok)")
    results = [CellResult(**{k: v for k, v in c.items() if k in _CELL_FIELDS}) for c in cells]
    return Run(path, results, {k: v for k, v in data.items() if k != "cells"})
