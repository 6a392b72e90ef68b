"""Throughput, MFU and memory metrics: console, metrics.jsonl, TensorBoard and optionally W&B.

FLOPs per token = 6 * (non-embedding params) + 12 * n_layers * dim * seq_len; MFU is
measured against the bf16 dense peak of the detected GPU (named in the startup log),
so float8 runs can exceed what the bf16 peak suggests: that is the point of float8.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch

from trainer import log
from trainer.metrics.wandb_sink import WandbSink

# Dense bf16 peak per GPU (no sparsity), in FLOP/s.
_BF16_PEAK = (("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("B200", 2250e12), ("A100", 312e12))

METRIC_KEYS = (
    "step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu_pct", "step_time_s", "data_time_s",
    "memory/peak_active_gib", "memory/peak_reserved_gib", "tokens_seen", "skipped_steps",
)


def flops_per_token(non_embedding_params: int, n_layers: int, dim: int, seq_len: int) -> int:
    return 6 * non_embedding_params + 12 * n_layers * dim * seq_len


def gpu_bf16_peak_flops(device: torch.device) -> tuple[str, float | None]:
    """(device name, dense bf16 peak FLOP/s or None when unknown, e.g. on CPU)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    for key, peak in _BF16_PEAK:
        if key in name:
            return name, peak
    return name, None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last reset: CUDA active/reserved, or the process's peak RSS on CPU."""
    gib = 1024**3
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "memory/peak_active_gib": stats.get("active_bytes.all.peak", 0) / gib,
            "memory/peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / gib,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib
    return {"memory/peak_active_gib": rss, "memory/peak_reserved_gib": rss}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _fmt_eta(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _keep_rows_up_to(path: Path, last_step: int) -> None:
    """Rewrite a metrics.jsonl atomically with only the rows of steps <= `last_step`.

    A run resumed from step k logs steps k+1.. again; the killed run's rows for them would
    otherwise stay as duplicates. A line that does not parse is the killed run's last write.
    """
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and type(row.get("step")) is int and row["step"] <= last_step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)


def _strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities as null: json.dumps would write NaN/Infinity, which strict JSON readers refuse."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


class JsonlAppender:
    """A JSON Lines file that only ever holds whole lines: a line is appended by one write of it all,
    and a write that fails (a full disk) is cut back to the previous line before the error goes on."""

    def __init__(self, path: Path, fresh: bool) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if fresh else 0), 0o644)
        self._size = os.fstat(self._fd).st_size

    def append(self, line: str) -> None:
        data = (line + "\n").encode()
        try:
            written = 0
            while written < len(data):  # a write may take only part of the line
                written += os.write(self._fd, data[written:])
        except OSError:
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    def close(self) -> None:
        os.close(self._fd)


class MetricsLogger:
    """Writes one record per logged step to the console, metrics.jsonl and TensorBoard (rank 0 only).

    `resume_step` is the step a resumed run continues after: metrics.jsonl and TensorBoard keep
    what was logged up to it and drop the rest. Without it (a fresh start) both start empty, so
    an old run in the same dump folder and run name does not mix in.
    """

    def __init__(self, dump_folder: str, run_name: str, enable_tensorboard: bool, is_main: bool,
                 config_text: str = "", resume_step: int | None = None, wandb_project: str | None = None) -> None:
        self.is_main = is_main
        self._jsonl = None
        self._tb = None
        self._wandb: WandbSink | None = None
        if not is_main:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        jsonl = folder / "metrics.jsonl"
        if resume_step is not None:
            _keep_rows_up_to(jsonl, resume_step)
        self._jsonl = JsonlAppender(jsonl, fresh=resume_step is None)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = folder / "tb" / run_name
            if resume_step is None:
                for old in tb_dir.glob("events.out.tfevents.*"):
                    old.unlink()
            first_step = 0 if resume_step is None else resume_step + 1
            # purge_step makes TensorBoard discard the killed run's events from first_step on.
            self._tb = SummaryWriter(str(tb_dir), purge_step=None if resume_step is None else first_step)
            if config_text:
                self._tb.add_text("config", "```\n" + config_text + "\n```", first_step)
            self._tb.add_custom_scalars(_dashboard_layout())
        if wandb_project is not None:
            self._wandb = WandbSink(folder, wandb_project, run_name, config_text, resumed=resume_step is not None)

    def log(self, record: dict[str, Any], total_steps: int, eta_s: float | None = None) -> None:
        if not self.is_main:
            return
        assert self._jsonl is not None
        self._jsonl.append(json.dumps(_strict_json(record), allow_nan=False))
        step = record["step"]
        scalars = {_tb_tag(k): v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step)
        mfu = record.get("mfu_pct")
        mfu_txt = f"  mfu {mfu:5.1f}%" if mfu is not None else ""
        eta_txt = f"  eta {_fmt_eta(eta_s)}" if eta_s is not None else ""
        log.info(
            f"step {step:>6}/{total_steps}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}"
            f"  lr {record['lr']:.2e}  tps {record['tps']:,.0f}{mfu_txt}"
            f"  mem {record['memory/peak_active_gib']:.2f}GiB  step {record['step_time_s'] * 1000:.0f}ms{eta_txt}"
        )

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            tb, self._tb = self._tb, None
            tb.close()
        if self._wandb is not None:
            sink, self._wandb = self._wandb, None
            sink.close()


_TB_GROUPS = {
    "tps": "throughput", "tflops": "throughput", "mfu_pct": "throughput",
    "loss": "loss", "grad_norm": "loss", "lr": "loss",
    "step_time_s": "time", "data_time_s": "time", "fwd_bwd_time_s": "time",
    "tokens_seen": "progress", "skipped_steps": "progress",
}


def _tb_tag(key: str) -> str:
    """TensorBoard tag grouped by dashboard section (throughput/, memory/, loss/, time/)."""
    if "/" in key:
        return key
    return f"{_TB_GROUPS.get(key, 'other')}/{key}"


def _dashboard_layout() -> dict[str, dict[str, list[Any]]]:
    """Custom-scalars layout in SummaryWriter.add_custom_scalars' dict form; tags are regexes."""

    def chart(*tags: str) -> list[Any]:
        return ["Multiline", list(tags)]

    return {
        "throughput (all runs)": {
            "tokens/s per GPU": chart(r"throughput/tps"),
            "achieved TFLOP/s per GPU": chart(r"throughput/tflops"),
            "MFU % (vs bf16 dense peak)": chart(r"throughput/mfu_pct"),
        },
        "memory": {"peak GiB": chart(r"memory/.*")},
        "training": {
            "loss": chart(r"loss/loss"), "grad norm": chart(r"loss/grad_norm"), "lr": chart(r"loss/lr"),
        },
        "validation": {
            "held-out loss": chart(r"validation/loss"), "perplexity": chart(r"validation/perplexity"),
            "response-token accuracy (SFT)": chart(r"validation/accuracy"),
        },
        "time": {"seconds per step": chart(r"time/.*")},
        # metrics.float8_stats_freq: the worst float8 linear per quantity (float8/<layer>/... per layer).
        "float8 health (worst layer)": {
            # The norm shares first: they measure harm; the counts only how many values were touched.
            "underflow (share of the squared norm cast to 0)": chart(r"float8/worst/.*/underflow_norm_share$"),
            "saturation (share of the squared norm clipped at the float8 maximum)":
                chart(r"float8/worst/.*/saturation_norm_share$"),
            "underflow (share of non-zero values cast to 0)": chart(r"float8/worst/.*/underflow$"),
            "saturation (share at the float8 maximum)": chart(r"float8/worst/.*/saturation$"),
            "amax": chart(r"float8/worst/.*/amax$"),
            "amax growth since the first health step": chart(r"float8/worst/.*/amax_growth"),
            "smallest scale": chart(r"float8/worst/.*/scale"),
        },
    }


class StepTimer:
    """Marks inside a step that cost no host-device sync: CUDA events on GPU, the host clock on CPU.

    A step is launched without waiting for the device, so host clocks only time what the
    device has finished; `seconds` reads two marks once the work after both has completed.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        # Reading the loss only waits for the work before it: the optimizer step after it may
        # still be running, and elapsed_time raises on an event that has not completed.
        end.synchronize()
        return start.elapsed_time(end) / 1000
