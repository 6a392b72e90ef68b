"""scripts/profile_summary.py: exact class times on a synthetic GPU trace, a real CPU trace, bad input."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from float8 import Float8Config, convert_to_float8_training
from scripts import profile_summary as ps
from tests.helpers import ROOT

CPU, GPU = 100, 0


def _cpu(name: str, start_ms: float, end_ms: float, ext: int | None = None, tid: int = 1,
         cat: str = "cpu_op", corr: int | None = None) -> dict:
    args = {k: v for k, v in (("External id", ext), ("correlation", corr)) if v is not None}
    return {"ph": "X", "cat": cat, "name": name, "pid": CPU, "tid": tid, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


def _gpu(name: str, start_ms: float, end_ms: float, corr: int | None = None, ext: int | None = None,
         stream: int = 7, cat: str = "kernel") -> dict:
    args = {"device": 0, "stream": stream}
    args.update({k: v for k, v in (("External id", ext), ("correlation", corr)) if v is not None})
    return {"ph": "X", "cat": cat, "name": name, "pid": GPU, "tid": stream, "ts": start_ms * 1e3,
            "dur": (end_ms - start_ms) * 1e3, "args": args}


def synthetic_trace() -> dict:
    """One step: every class, NCCL on its own stream partly hidden under compute, two gaps."""
    launch = "cudaLaunchKernel"
    cpu = [
        _cpu("aten::linear", -3.0, -2.5, ext=1),
        _cpu("aten::mm", -2.9, -2.6, ext=2),
        _cpu(launch, -2.8, -2.7, ext=2, cat="cuda_runtime", corr=102),
        _cpu("aten::add", -2.0, -1.8, ext=3),
        _cpu(launch, -1.95, -1.9, ext=3, cat="cuda_runtime", corr=107),
        _cpu("Optimizer.step#AdamW.step", 0.0, 30.0, ext=4, cat="user_annotation"),
        _cpu("aten::mul", 1.0, 2.0, ext=5),
        _cpu(launch, 1.1, 1.2, ext=5, cat="cuda_runtime", corr=108),
        # The autograd thread: a copy (a float8 transpose) linked to its op by External id only.
        _cpu("autograd::engine::evaluate_function: _Float8MatmulBackward", -1.0, 0.0, tid=2),
        _cpu("_Float8MatmulBackward", -0.95, -0.05, tid=2),
        _cpu("aten::copy_", -0.9, -0.8, ext=6, tid=2),
    ]
    gpu = [
        _gpu("sm90_xmma_gemm_e4m3bf16_bf16f32_f32_tn_n_tilesize128x128x128", 0, 10),
        _gpu("Kernel2", 10, 13, corr=102),  # a GEMM by the op that launched it (aten::mm)
        _gpu("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", 13, 17),
        _gpu("void at::native::unrolled_elementwise_kernel<at::native::float8_copy_kernel_cuda>", 17, 18),
        _gpu("triton_red_fused_abs_amax_0", 18, 19.5),
        _gpu("void at::native::elementwise_kernel<128, 4>", 19.5, 20, ext=6),
        _gpu("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", 25, 27, corr=107),
        _gpu("void at::native::vectorized_elementwise_kernel<4, MulFunctor>", 27, 29, corr=108),
        _gpu("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>", 29, 30),
        _gpu("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 5, 12, stream=20),  # hidden under GEMMs
        _gpu("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 21, 23, stream=20),  # alone, in a gap
        _gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 29.5, 34, stream=20),  # 0.5 ms hidden
        _gpu("Memcpy DtoH (Device -> Pinned)", 36, 37, cat="gpu_memcpy", stream=9),
        # Device-side spans of CPU annotations are not kernels: they must not fill the gaps.
        _gpu("Optimizer.step#AdamW.step", 0, 37, cat="gpu_user_annotation"),
    ]
    meta = [{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "x",
             "ts": -100e3, "dur": 300e3},
            {"ph": "M", "name": "process_name", "pid": GPU, "args": {"name": "GPU 0"}},
            {"ph": "s", "id": 102, "pid": CPU, "tid": 1, "ts": -2.8e3, "cat": "ac2g", "name": "ac2g"}]
    return {"schemaVersion": 1, "traceEvents": meta + cpu + gpu}


EXPECTED = {
    "gemm": {"ms": 13.0, "count": 2},
    "attention": {"ms": 4.0, "count": 1},
    "float8": {"ms": 3.0, "count": 3},
    "elementwise": {"ms": 2.0, "count": 1},
    "optimizer": {"ms": 3.0, "count": 2},
    "memcpy": {"ms": 1.0, "count": 1},
    "nccl": {"ms": 13.5, "count": 3},
}


def test_synthetic_gpu_trace_exact_times():
    s = ps.summarize(synthetic_trace())
    assert s["device"] == "gpu" and s["devices"] == 1
    assert s["classes"] == EXPECTED
    # NCCL alone: the reduce-scatter in the gap (2 ms) and the all-reduce after compute ends (4 ms).
    assert s["nccl_not_overlapped_ms"] == 6.0
    # No activity in [20, 21), [23, 25) and [34, 36).
    assert s["gpu_idle_ms"] == 5.0
    assert s["step_wall_ms"] == 40.0  # first CPU op at -3 ms to the memcpy's end at 37 ms
    assert s["top"][0] == {"class": "gemm", "name": gpu_name(0), "ms": 10.0, "count": 1}


def gpu_name(i: int) -> str:
    return [e for e in synthetic_trace()["traceEvents"] if e.get("cat") == "kernel"][i]["name"]


def test_cli_json_text_and_gzip(tmp_path, capsys):
    plain, packed = tmp_path / "rank-0.json", tmp_path / "rank-1.json.gz"
    plain.write_text(json.dumps(synthetic_trace()))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert ps.main(["--json", str(plain), str(packed)]) == 0
    out = json.loads(capsys.readouterr().out)["traces"]
    assert [t["path"] for t in out] == [str(plain), str(packed)]
    assert out[0]["classes"] == out[1]["classes"] == EXPECTED
    assert ps.main([str(plain), str(packed), "--top", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line[:30].strip(): line[30:].split() for line in lines[3:] if line.strip()}
    assert rows["GEMM"] == ["13.00", "(2)", "13.00", "(2)"]
    assert rows["NCCL not overlapped"] == ["6.00", "6.00"]
    assert rows["GPU idle"] == ["5.00", "5.00"] and rows["step wall time"] == ["40.00", "40.00"]


def test_a_real_cpu_trace_is_summarised_by_op(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
    convert_to_float8_training(model, config=Float8Config(scaling="tensorwise"))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        model(torch.randn(16, 64)).float().pow(2).mean().backward()
        opt.step()
        # The CPU float8 linear computes its GEMMs without torch._scaled_mm (float8/gemm.py),
        # so the trace gets two of torch's own, as a GPU step has them.
        a = torch.randn(16, 64).to(torch.float8_e4m3fn)
        for _ in range(2):
            torch._scaled_mm(a, a.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.bfloat16)
    path = tmp_path / "rank-0.json"
    prof.export_chrome_trace(str(path))
    scaled_mm_calls = sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")

    result = subprocess.run([sys.executable, "scripts/profile_summary.py", str(path), "--top", "1000"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no GPU kernels in this trace" in result.stdout.splitlines()[0]
    s = ps.summarize(ps.load_trace(path), top=1000)
    assert s["device"] == "cpu" and "gpu_idle_ms" not in s
    by_name = {(t["class"], t["name"]): t["count"] for t in s["top"]}
    classes = {name: cls for cls, name in by_name}
    assert scaled_mm_calls == 2 and by_name[("gemm", "aten::_scaled_mm")] == scaled_mm_calls
    assert classes["_Float8Matmul"] == classes["_Float8MatmulBackward"] == classes["aten::abs"] == "float8"
    assert classes["aten::_foreach_add_"] == "optimizer" and classes["aten::relu"] == "elementwise"
    assert s["classes"]["attention"]["count"] == s["classes"]["nccl"]["count"] == 0
    # Self times on one thread cannot add up to more than the step.
    assert 0 < sum(c["ms"] for c in s["classes"].values()) <= s["step_wall_ms"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        (b"not json", "not JSON"),
        (b'{"traceEvents": []}', "not a torch.profiler Chrome trace"),
        (b"[1, 2]", "not a torch.profiler Chrome trace"),
        (gzip.compress(b"{"), "not JSON"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content)
    result = subprocess.run([sys.executable, "scripts/profile_summary.py", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: {message}") and len(result.stderr.splitlines()) == 1
