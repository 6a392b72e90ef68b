"""scripts/gpu_check.py's table: one Row per check, rendered for stdout and gpu_check.md."""

from __future__ import annotations

import dataclasses
from typing import Any

from scripts.harness.compare.report import format_number
from scripts.harness.gpu_check.checks import WARMUP


@dataclasses.dataclass
class Row:
    """One line of the pass/fail table: what it runs, its result, and the commands that got it."""

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


HEADER = ("| row | layout | precision | compile | result | tokens/s/GPU | peak mem GiB | first-step s "
          "| notes |\n|---|---|---|---|---|--:|--:|--:|---|")


def render_table(rows: list[Row]) -> str:
    """The Markdown table, one line per row; skipped rows say why."""
    lines = [HEADER]
    for r in rows:
        result = r.result or "not run"
        if r.result == "skipped":
            result = f"skipped ({r.reason})"
        elif r.reason:
            result += f": {r.reason}"
        cells = [r.name, r.layout, r.precision, r.compile, result.replace("|", "/"),
                 *("" if x is None else format_number(x) for x in (r.tps, r.peak_gib, r.first_step_s)),
                 "; ".join(r.notes)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_markdown(rows: list[Row], info: dict[str, Any]) -> str:
    """gpu_check.md: the table, what its numbers are, and the command, date and device."""
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
