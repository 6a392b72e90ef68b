"""Where a profiled step's time went: device time by kernel class from a torch.profiler trace
(scripts/profile_summary.py prints it; the comparison and float8 benchmark reports add it per cell).

Reads Chrome traces as trainer/metrics/profiling.py writes them (`--profiling.enable true
--profiling.steps [N]`; `.json` or `.json.gz`). Each GPU kernel is classed by its name
and by the CPU ops that launched it (the kernel's `correlation` / `External id` lead to
the launch on its CPU thread, and that thread's enclosing ops give the context):

    GEMM          cuBLAS/CUTLASS/nvjet/Triton-template (`triton_tem_*mm`) GEMMs, float8
                  `_scaled_mm`; never Inductor's pointwise/reduction kernels (triton_poi/red/per),
                  which are named after all the ops they fuse, `_scaled_mm` too
    attention     flash / efficient / cuDNN / flex attention, anything under SDPA
    float8 casts  float8 conversion and transposes, abs/amax reductions, scale math:
                  kernels under the float8 matmul's autograd function (ours and torchao's),
                  eager abs/amax/max, ops on float8 tensors, fused Triton kernels whose ops
                  include abs, amax, reciprocal or clamp + to_copy, and the float8 weight
                  casts (mul, clamp, abs/max, cast to float8) that FSDP's pre-all-gather
                  launches under FSDP::pre_forward / pre_backward / all_gather(_copy_in),
                  and the float8 weights' amaxes (a `_foreach_norm` of order inf)
    optimizer     kernels launched under Optimizer.step, foreach and fused-Adam kernels
    FSDP copies   all else FSDP launches itself (under its FSDP:: annotations and fsdp:: ops),
                  kernels and memcpys: all-gather copy-in and copy-out, the bf16 param and
                  input casts, the reduce-scatter's chunk_cat copy-in and its copy-out
    NCCL          collectives; "not overlapped" is NCCL time with no other kernel running

plus the rest (other elementwise/reduction, memcpy/memset), the step's wall time (first
to last event), and GPU idle: time between the step's first and last GPU activity when no
kernel, copy or collective runs on the device. A trace without GPU kernels (a CPU run) is
summarised by the self time of its CPU ops in the same classes. A GPU trace also lists the host
events with most self time (CPU ops, runtime calls, annotations: Python between ops counts in
the event around it, such as ProfilerStep#N or an inductor graph's call): where a step whose GPU
idles waits on its host spends it, and, as synchronisations, where a host waits on its GPU.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

CLASSES = {
    "gemm": "GEMM",
    "attention": "attention",
    "float8": "float8 casts",
    "elementwise": "other elementwise/reduction",
    "optimizer": "optimizer",
    "memcpy": "memcpy/memset",
    "fsdp": "FSDP copies",
    "nccl": "NCCL",
}
GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memcpy"}
CPU_CATEGORIES = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}

_NCCL_KERNEL = re.compile(r"nccl", re.I)
_COLLECTIVE_OP = re.compile(r"^(?:c10d::|nccl:|gloo:)|record_param_comms", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|flex", re.I)
_GEMM_KERNEL = re.compile(r"gemm|cutlass|cublas|nvjet|xmma|scaled_mm|matmul|triton_tem_fused_\w*mm", re.I)
_INDUCTOR_FUSED = re.compile(r"^triton_(?:poi|red|per)_")
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
             "aten::_scaled_mm", "aten::_grouped_mm"}
_FLOAT8_NAME = re.compile(r"float8|fp8|e4m3|e5m2", re.I)
# Ops of a float8 cast that nothing else in a LLaMA step launches (reciprocal is the loss's too).
_FLOAT8_OPS = {"aten::abs", "aten::amax", "aten::max"}
# FSDP2's record_function annotations (FSDP::pre_forward (layers.3)) and custom ops
# (fsdp::chunk_cat): FSDP's own work, launched outside the model's ops.
_FSDP = re.compile(r"^(?:FSDP|fsdp)::")
# Where FSDP calls fsdp_pre_all_gather, which casts float8 weights: on one GPU in pre_forward /
# pre_backward, on more in all_gather (all_gather_copy_in in newer torch). The fsdp:: ops
# inside, the copy-out and the reduce side only move data, float8 bytes included.
_FSDP_UNSHARD = re.compile(r"^FSDP::(?:pre_forward|pre_backward|all_gather|all_gather_copy_in)(?: \(|$)")
# FSDP's unshard itself only copies: scale math there is a float8 weight cast.
_FSDP_CAST_OPS = _FLOAT8_OPS | {"aten::mul", "aten::clamp", "aten::reciprocal"}
_OPTIMIZER = re.compile(r"optimizer\.(?:step|zero_grad)|_foreach_|fused_adam|multi_tensor_apply|adam", re.I)


# Timestamps are float microseconds: a child may end a rounding error after its parent.
_TIE_US = 0.01


class TraceError(Exception):
    """The file is missing, unreadable, not JSON or not a profiler trace."""


def load_trace(path: Path) -> dict[str, Any]:
    """The parsed trace; raises TraceError with a one-line reason."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        trace = json.loads(text)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not JSON ({e})") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list) or not any(_is_span(e) for e in events):
        raise TraceError(f"{path}: not a torch.profiler Chrome trace (no traceEvents with durations)")
    return trace


def _is_span(e: Any) -> bool:
    return isinstance(e, dict) and e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) \
        and isinstance(e.get("dur"), (int, float))


def _union(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class _Threads:
    """CPU events per thread, nested by time: what enclosed a launch, and each op's self time."""

    def __init__(self, cpu_events: list[dict[str, Any]]) -> None:
        by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
        for e in cpu_events:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        self.parent: dict[int, dict[str, Any] | None] = {}
        self.children_us: dict[int, float] = {}
        for events in by_thread.values():
            # Parents start earlier or equal and end later; ties put the longer one first.
            events.sort(key=lambda e: (e["ts"], -e["dur"]))
            stack: list[dict[str, Any]] = []
            for e in events:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"] + e["dur"] - _TIE_US:
                    stack.pop()
                parent = stack[-1] if stack else None
                self.parent[id(e)] = parent
                if parent is not None:
                    self.children_us[id(parent)] = self.children_us.get(id(parent), 0.0) + e["dur"]
                stack.append(e)

    def chain(self, e: dict[str, Any] | None) -> list[dict[str, Any]]:
        """`e` and the events enclosing it, innermost first."""
        out = []
        while e is not None:
            out.append(e)
            e = self.parent.get(id(e))
        return out

    def self_us(self, e: dict[str, Any]) -> float:
        return max(e["dur"] - self.children_us.get(id(e), 0.0), 0.0)


def _inductor_float8(name: str) -> bool:
    # Inductor names fused kernels after their aten ops: triton_red_fused_abs_amax_0,
    # triton_poi_fused__to_copy_clamp_mul_1 (the clamp to the float8 range, then the cast).
    if not name.startswith(("triton_", "cpp_fused")):
        return False
    ops = set(name.split("_"))
    return bool(ops & {"abs", "amax", "reciprocal"}) or {"to", "copy", "clamp"} <= ops


def _gemm(kernel: str | None, names: list[str]) -> bool:
    # Inductor names these after every op they fuse, the _scaled_mm their casts feed included.
    if kernel and _INDUCTOR_FUSED.match(kernel):
        return False
    return bool(kernel and _GEMM_KERNEL.search(kernel)) or any(n in _GEMM_OPS for n in names)


def _float8_cast(kernel: str | None, chain: list[dict[str, Any]], ops: set[str]) -> bool:
    """By the kernel's name, the names around its launch, or the op that launched it."""
    if kernel and (_FLOAT8_NAME.search(kernel) or _inductor_float8(kernel)):
        return True
    if any(_FLOAT8_NAME.search(e.get("name", "")) for e in chain):
        return True
    launch_op = next((e for e in chain if e.get("cat") == "cpu_op"), None)
    return launch_op is not None and (
        launch_op["name"] in ops or _inductor_float8(launch_op["name"])
        or "Float8" in str(launch_op.get("args", {}).get("Input type", ""))
        or _weight_amax(launch_op)
    )


def _weight_amax(op: dict[str, Any]) -> bool:
    # The float8 weights' amaxes (precompute_float8_scales_for_fsdp) are an inf-norm; the
    # grad-norm clip's foreach_norm has ord 2.
    return op["name"] == "aten::_foreach_norm" and "inf" in op.get("args", {}).get("Concrete Inputs", [])


def _innermost_fsdp(chain: list[dict[str, Any]]) -> int | None:
    return next((i for i, e in enumerate(chain) if _FSDP.match(e.get("name", ""))), None)


def _fsdp_class(kernel: str | None, chain: list[dict[str, Any]]) -> str | None:
    """The class of what FSDP launched itself (float8 or fsdp); None for anything else."""
    at = _innermost_fsdp(chain)
    if at is None:
        return None
    # Only the events below FSDP's: an op above it did not launch this.
    if _FSDP_UNSHARD.match(chain[at]["name"]) and _float8_cast(kernel, chain[:at], _FSDP_CAST_OPS):
        return "float8"
    return "fsdp"


def classify(kernel: str | None, chain: list[dict[str, Any]]) -> str:
    """Class of a GPU kernel (its name, the CPU events around its launch) or of a CPU op
    (`kernel` None, the op first in `chain`)."""
    names = [e.get("name", "") for e in chain]
    if kernel is not None and _NCCL_KERNEL.search(kernel):
        return "nccl"
    if kernel is None and any(_COLLECTIVE_OP.search(n) for n in names):
        return "nccl"
    # Before the name rules: FSDP's annotations carry module names (layers.0.attention).
    fsdp = _fsdp_class(kernel, chain)
    if fsdp is not None:
        return fsdp
    if any(_ATTENTION.search(n) for n in [kernel or "", *names]):
        return "attention"
    if _gemm(kernel, names):
        return "gemm"
    if _float8_cast(kernel, chain, _FLOAT8_OPS):
        return "float8"
    if any(_OPTIMIZER.search(n) for n in [kernel or "", *names]):
        return "optimizer"
    return "elementwise"


def _copy_class(chain: list[dict[str, Any]]) -> str:
    # FSDP's memcpys are its all-gather / reduce-scatter buffers, float8 bytes or not.
    return "memcpy" if _innermost_fsdp(chain) is None else "fsdp"


def _empty_classes() -> dict[str, dict[str, float]]:
    return {key: {"ms": 0.0, "count": 0} for key in CLASSES}


def _host_top(cpu: list[dict[str, Any]], threads: _Threads, top: int) -> list[dict[str, Any]]:
    """The `top` host event names with most self time, summed over every CPU thread."""
    by_name: dict[str, list[float]] = {}
    for e in cpu:
        entry = by_name.setdefault(e.get("name", ""), [0.0, 0])
        entry[0] += threads.self_us(e) / 1e3
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n, "ms": round(ms, 3), "count": k} for n, (ms, k) in ranked]


def summarize(trace: dict[str, Any], top: int = 5) -> dict[str, Any]:
    """Per-class times (ms) and counts, NCCL overlap, GPU idle and wall time of one trace."""
    spans = [e for e in trace["traceEvents"] if _is_span(e) and e.get("cat") != "Trace"]
    gpu = [e for e in spans if str(e.get("cat", "")).lower() in GPU_CATEGORIES]
    cpu = [e for e in spans if str(e.get("cat", "")).lower() in CPU_CATEGORIES]
    threads = _Threads(cpu)
    wall_us = max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)
    classes = _empty_classes()
    by_name: dict[tuple[str, str], list[float]] = {}

    def add(cls: str, name: str, us: float) -> None:
        classes[cls]["ms"] += us / 1e3
        classes[cls]["count"] += 1
        entry = by_name.setdefault((cls, name), [0.0, 0])
        entry[0] += us / 1e3
        entry[1] += 1

    result: dict[str, Any] = {"device": "gpu" if gpu else "cpu", "step_wall_ms": wall_us / 1e3}
    if gpu:
        launches = {e["args"]["correlation"]: e for e in cpu
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        ops = {e["args"]["External id"]: e for e in cpu
               if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
        per_device: dict[Any, dict[str, list[tuple[float, float]]]] = {}
        for e in gpu:
            args = e.get("args", {})
            kind = GPU_CATEGORIES[str(e["cat"]).lower()]
            launch = launches.get(args.get("correlation")) or ops.get(args.get("External id"))
            cls = _copy_class(threads.chain(launch)) if kind == "memcpy" \
                else classify(e.get("name", ""), threads.chain(launch))
            add(cls, e.get("name", ""), e["dur"])
            lanes = per_device.setdefault(args.get("device", e.get("pid")), {"all": [], "nccl": [], "compute": []})
            interval = (e["ts"], e["ts"] + e["dur"])
            lanes["all"].append(interval)
            if cls == "nccl":
                lanes["nccl"].append(interval)
            elif kind == "kernel":
                lanes["compute"].append(interval)
        idle = nccl_alone = 0.0
        for lanes in per_device.values():
            first = min(s for s, _ in lanes["all"])
            last = max(t for _, t in lanes["all"])
            idle += (last - first) - _union(lanes["all"])
            nccl_alone += _union(lanes["nccl"] + lanes["compute"]) - _union(lanes["compute"])
        result.update(gpu_idle_ms=idle / 1e3, nccl_not_overlapped_ms=nccl_alone / 1e3, devices=len(per_device))
        result["host_top"] = _host_top(cpu, threads, top)
    else:
        for e in cpu:
            if e.get("cat") == "cpu_op":
                add(classify(None, threads.chain(e)), e.get("name", ""), threads.self_us(e))
    result["classes"] = {k: {"ms": round(v["ms"], 3), "count": v["count"]} for k, v in classes.items()}
    for key in ("step_wall_ms", "gpu_idle_ms", "nccl_not_overlapped_ms"):
        if key in result:
            result[key] = round(result[key], 3)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    result["top"] = [{"class": c, "name": n, "ms": round(ms, 3), "count": k} for (c, n), (ms, k) in ranked]
    return result
