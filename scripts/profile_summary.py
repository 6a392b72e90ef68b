"""Where a profiled step's time went: device time by kernel class from torch.profiler traces.

    python scripts/profile_summary.py outputs/debug/profiles/step-5/rank-0.json
    python scripts/profile_summary.py bf16/rank-0.json fp8/rank-0.json.gz   # side by side
    python scripts/profile_summary.py --json TRACE.json                     # for machines

Reads Chrome traces as trainer/metrics/profiling.py writes them (`--profiling.enable true
--profiling.steps [N]`; `.json` or `.json.gz`) and prints, per trace, the device time of each
kernel class (GEMM, attention, float8 casts, optimizer, FSDP copies, NCCL and the rest), NCCL
time not overlapped, GPU idle time, the step's wall time, the kernels with most time and the
host events with most self time (where the host goes when the GPU idles).
How a kernel is classed: scripts/harness/traces.py. A trace without GPU kernels (a CPU run) is
summarised by the self time of its CPU ops in the same classes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from scripts.harness.traces import CLASSES, TraceError, load_trace, summarize
from trainer.cli import ArgParser


def _row(label: str, cells: list[str]) -> str:
    return f"{label:30}" + "".join(f"{c:>20}" for c in cells)


def render(paths: list[str], summaries: list[dict[str, Any]]) -> str:
    """One column per trace: ms and count per class, NCCL overlap, idle, wall time; then top kernels."""
    lines = []
    for i, (path, s) in enumerate(zip(paths, summaries), 1):
        what = (f"GPU kernels on {s['devices']} device(s)" if s["device"] == "gpu"
                else "no GPU kernels in this trace; CPU op self time by class")
        lines.append(f"[{i}] {path}: {what}")
    lines += ["", _row("", [f"[{i}] ms (count)" for i in range(1, len(paths) + 1)])]
    for key, label in CLASSES.items():
        lines.append(_row(label, [f"{s['classes'][key]['ms']:.2f} ({s['classes'][key]['count']})" for s in summaries]))
    for key, label in (("nccl_not_overlapped_ms", "NCCL not overlapped"), ("gpu_idle_ms", "GPU idle"),
                       ("step_wall_ms", "step wall time")):
        lines.append(_row(label, ["-" if key not in s else f"{s[key]:.2f}" for s in summaries]))
    for i, s in enumerate(summaries, 1):
        if s["top"]:
            lines += ["", f"[{i}] top {'kernels' if s['device'] == 'gpu' else 'CPU ops'} by time:"]
            lines += [f"  {t['ms']:10.2f} ms {t['count']:6}x  {t['class']:11}  {t['name'][:100]}" for t in s["top"]]
        if s.get("host_top"):
            lines += ["", f"[{i}] top host events by self time (CPU ops, runtime calls, annotations):"]
            lines += [f"  {t['ms']:10.2f} ms {t['count']:6}x  {t['name'][:100]}" for t in s["host_top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="profiles/step-N/rank-R.json[.gz]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--top", type=int, default=5, help="list the N kernels (or CPU ops) with most time (default 5)")
    opts = parser.parse_args(argv)
    if opts.top < 0:
        parser.error(f"--top must be >= 0, got {opts.top}")
    try:
        summaries = [summarize(load_trace(Path(p)), opts.top) for p in opts.traces]
    except TraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if opts.json:
        print(json.dumps({"traces": [{"path": p, **s} for p, s in zip(opts.traces, summaries)]}, indent=2))
    else:
        print(render(opts.traces, summaries))
    return 0


if __name__ == "__main__":
    from trainer.cli import run_command
    sys.exit(run_command(main))
