"""scripts/profile_summary.py and scripts/harness/traces.py: exact class times on a synthetic GPU trace,
a real CPU trace, bad input."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch import nn

from float8 import Float8Config, convert_to_float8_training
from scripts import profile_summary as ps
from scripts.harness import traces
from tests.helpers import run_script

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
    "fsdp": {"ms": 0.0, "count": 0},
    "nccl": {"ms": 13.5, "count": 3},
}


def test_synthetic_gpu_trace_exact_times():
    s = traces.summarize(synthetic_trace())
    assert s["device"] == "gpu" and s["devices"] == 1
    assert s["classes"] == EXPECTED
    # NCCL alone: the reduce-scatter in the gap (2 ms) and the all-reduce after compute ends (4 ms).
    assert s["nccl_not_overlapped_ms"] == 6.0
    # No activity in [20, 21), [23, 25) and [34, 36).
    assert s["gpu_idle_ms"] == 5.0
    assert s["step_wall_ms"] == 40.0  # first CPU op at -3 ms to the memcpy's end at 37 ms
    assert s["top"][0] == {"class": "gemm", "name": gpu_name(0), "ms": 10.0, "count": 1}
    # Host self time: the optimizer's annotation less the mul inside it; the mul less its launch.
    assert s["host_top"][:2] == [{"name": "Optimizer.step#AdamW.step", "ms": 29.0, "count": 1},
                                 {"name": "aten::mul", "ms": 0.9, "count": 1}]


def _launched(op: str, start_ms: float, end_ms: float, corr: int, types: list[str] | None = None,
              tid: int = 1, call: str = "cudaLaunchKernel") -> list[dict]:
    """A CPU op and, inside it, the runtime call that launched GPU work `corr`."""
    op_event = _cpu(op, start_ms, end_ms, tid=tid)
    if types is not None:
        op_event["args"]["Input type"] = types
    mid = (start_ms + end_ms) / 2
    cat = "cuda_driver" if call == "cuLaunchKernel" else "cuda_runtime"
    return [op_event, _cpu(call, mid - 0.01, mid + 0.01, tid=tid, cat=cat, corr=corr)]


def fsdp_and_inductor_trace() -> dict:
    """FSDP2's unshard and reduce-scatter (on one GPU as the H200 traces have them: casts and
    copies right under FSDP::pre_forward; on more as torch's _fsdp_collectives.py runs them:
    under FSDP::all_gather and its fsdp:: ops), and Inductor kernels named after the
    _scaled_mm their casts feed."""
    f8, bf16 = ["c10::Float8_e4m3fn", "float", "Scalar"], ["c10::BFloat16", "float", "Scalar"]
    note = "user_annotation"
    cpu = [
        _cpu("FSDP::pre_forward (layers.0)", 0, 10, cat=note),
        *_launched("aten::mul", 1, 2, 301, ["float", "float"]),
        *_launched("aten::clamp", 2, 3, 302, ["float", "Scalar", "Scalar"]),
        _cpu("aten::to", 3, 4), _cpu("aten::_to_copy", 3.1, 3.9), *_launched("aten::copy_", 3.2, 3.8, 303, f8),
        *_launched("aten::copy_", 4, 5, 304, ["unsigned char", "unsigned char", "Scalar"], call="cudaMemcpyAsync"),
        _cpu("aten::to", 5, 6), _cpu("aten::_to_copy", 5.1, 5.9), *_launched("aten::copy_", 5.2, 5.8, 305, bf16),
        _cpu("FSDP::all_gather (layers.1)", 10, 20, cat=note),
        *_launched("aten::abs", 11, 12, 306, ["float"]),
        _cpu("fsdp::all_gather_copy_in", 12, 14), *_launched("aten::_foreach_copy_", 12.5, 13.5, 307),
        *_launched("c10d::_allgather_base_", 14, 15, 308),
        # Newer torch: fsdp_pre_all_gather under an FSDP::all_gather_copy_in annotation.
        _cpu("FSDP::all_gather_copy_in (layers.2)", 15, 20, cat=note),
        *_launched("aten::mul", 16, 17, 319, ["float", "float"]),
        _cpu("FSDP::all_gather_copy_out (layers.1)", 20, 25, cat=note),
        _cpu("fsdp::split_with_sizes_copy", 20.5, 24.5),
        *_launched("aten::split_with_sizes_copy", 21, 24, 309, call="cudaMemcpyAsync"),
        # Older torch called it directly; torchao's float8 bytes are a copy here too, not a cast.
        *_launched("aten::split_with_sizes_copy", 24.6, 24.9, 320, ["c10::Float8_e4m3fn", "ScalarList"]),
        _cpu("Torch-Compiled Region: 0/0", 30, 40, cat=note), _cpu("CompiledFunction", 30.1, 39.9),
        _cpu("## Call CompiledFxGraph fabc ##", 30.2, 39.8, cat=note),
        *_launched("triton_poi_fused__scaled_mm__to_copy_abs_clamp_mul_reciprocal_t_view_3", 31, 32, 310,
                   ["c10::BFloat16", "float"], call="cuLaunchKernel"),
        *_launched("triton_tem_fused__scaled_mm_t_view_4", 32, 33, 311, ["c10::Float8_e4m3fn"], call="cuLaunchKernel"),
        *_launched("triton_poi_fused__scaled_mm_mul_silu_t_view_5", 33, 34, 312, ["c10::BFloat16"],
                   call="cuLaunchKernel"),
        # Backward, on the autograd thread: neither the module's name nor the float8 backward
        # whose gradient fired FSDP's hook make its copies attention or float8.
        _cpu("autograd::engine::evaluate_function: _Float8MatmulBackward", 40, 50, tid=2),
        _cpu("FSDP::pre_backward (layers.0.attention)", 41, 49, tid=2, cat=note),
        *_launched("aten::clamp", 42, 43, 313, ["float", "Scalar", "Scalar"], tid=2),
        _cpu("aten::to", 44, 45, tid=2), _cpu("aten::_to_copy", 44.1, 44.9, tid=2),
        *_launched("aten::copy_", 44.2, 44.8, 314, bf16, tid=2),
        _cpu("autograd::engine::evaluate_function: RegisterPostBackwardFunctionBackward", 50, 60, tid=2),
        _cpu("FSDP::post_backward_reduce (layers.0)", 50.5, 59.5, tid=2, cat=note),
        _cpu("fsdp::chunk_cat", 51, 55, tid=2), _cpu("aten::_chunk_cat", 51.1, 54.9, tid=2),
        _cpu("aten::to", 51.2, 52, tid=2), _cpu("aten::_to_copy", 51.3, 51.9, tid=2),
        *_launched("aten::copy_", 51.4, 51.8, 315, ["long int", "long int", "Scalar"], tid=2, call="cudaMemcpyAsync"),
        _cpu("cudaLaunchKernel", 53, 53.1, tid=2, cat="cuda_runtime", corr=316),
        *_launched("aten::copy_", 56, 57, 317, ["float", "float", "Scalar"], tid=2, call="cudaMemcpyAsync"),
        *_launched("aten::mul", 60.5, 61, 318, ["float", "float"], tid=2),  # not FSDP's: elementwise
    ]
    elementwise = "void at::native::vectorized_elementwise_kernel<4, at::native::"
    dtod = "Memcpy DtoD (Device -> Device)"
    gpu = [
        _gpu("void at::native::elementwise_kernel<128, 2, BinaryFunctor<float, float, float, MulFunctor>>", 0, 1, 301),
        _gpu(elementwise + "launch_clamp_scalar>", 1, 1.5, 302),
        _gpu(elementwise + "float8_copy_kernel_cuda>", 1.5, 2, 303),
        _gpu(dtod, 2, 2.25, 304, cat="gpu_memcpy"),
        _gpu(elementwise + "bfloat16_copy_kernel_cuda>", 2.25, 2.5, 305),
        _gpu("void at::native::reduce_kernel<512, 1, AbsFunctor>", 2.5, 3, 306),
        # Float8 bytes (torchao all-gathers float8, not uint8) in FSDP's copy-in are a copy, not a cast.
        _gpu("void at::native::multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor<c10::Float8_e4m3fn>>",
             3, 4, 307),
        _gpu("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 4, 6, 308, stream=20),
        _gpu(dtod, 6, 7.5, 309, cat="gpu_memcpy"),
        _gpu("triton_poi_fused__scaled_mm__to_copy_abs_clamp_mul_reciprocal_t_view_3", 7.5, 9.5, 310),
        _gpu("triton_tem_fused__scaled_mm_t_view_4", 9.5, 13.5, 311),
        _gpu("triton_poi_fused__scaled_mm_mul_silu_t_view_5", 13.5, 14.5, 312),
        _gpu(elementwise + "launch_clamp_scalar>", 14.5, 15, 313),
        _gpu(elementwise + "bfloat16_copy_kernel_cuda>", 15, 15.25, 314),
        _gpu("Memcpy HtoD (Pinned -> Device)", 15.25, 15.375, 315, cat="gpu_memcpy"),
        _gpu("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>", 15.375, 18.375, 316),
        _gpu(dtod, 18.375, 19.125, 317, cat="gpu_memcpy"),
        _gpu("void at::native::elementwise_kernel<128, 2, BinaryFunctor<float, float, float, MulFunctor>>",
             19.125, 19.625, 318),
        _gpu("Memcpy HtoD (Pageable -> Device)", 19.625, 20, cat="gpu_memcpy"),  # the batch: no FSDP op
        _gpu("void at::native::elementwise_kernel<128, 2, BinaryFunctor<float, float, float, MulFunctor>>",
             20, 20.5, 319),
        _gpu("void at::native::detail::split_with_sizes_copy_out_contiguous_no_cast_kernel", 20.5, 20.75, 320),
    ]
    return {"schemaVersion": 1, "traceEvents": cpu + gpu}


FSDP_EXPECTED = {
    "gemm": {"ms": 4.0, "count": 1},  # the Triton template only
    "attention": {"ms": 0.0, "count": 0},
    # mul 1 + clamp 0.5 + to float8 0.5 + abs 0.5 + mul 0.5 (forward), fused Triton cast 2,
    # clamp 0.5 (backward)
    "float8": {"ms": 5.5, "count": 7},
    "elementwise": {"ms": 1.5, "count": 2},  # triton_poi_fused__scaled_mm_mul_silu, the mul after FSDP
    "optimizer": {"ms": 0.0, "count": 0},
    "memcpy": {"ms": 0.375, "count": 1},
    # copy-out stand-in 0.25, bf16 casts 0.25 + 0.25, copy-in 1, split_with_sizes_copy 1.5 + 0.25,
    # chunk_cat's sizes 0.125 and kernel 3, reduce-scatter copy-out 0.75
    "fsdp": {"ms": 7.375, "count": 9},
    "nccl": {"ms": 2.0, "count": 1},
}


def test_fsdp_and_inductor_kernels_exact_times():
    s = traces.summarize(fsdp_and_inductor_trace(), top=100)
    assert s["classes"] == FSDP_EXPECTED
    by_name = {t["name"]: t["class"] for t in s["top"]}
    assert by_name["triton_poi_fused__scaled_mm__to_copy_abs_clamp_mul_reciprocal_t_view_3"] == "float8"
    assert by_name["triton_tem_fused__scaled_mm_t_view_4"] == "gemm"
    assert by_name["triton_poi_fused__scaled_mm_mul_silu_t_view_5"] == "elementwise"
    assert by_name["void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>"] == "fsdp"
    rows = {line[:30].strip(): line[30:].split() for line in ps.render(["t"], [s]).splitlines()}
    assert rows["FSDP copies"] == ["7.38", "(9)"] and rows["memcpy/memset"] == ["0.38", "(1)"]


def test_weight_amax_inf_norm_is_a_float8_cast_and_the_grad_norm_is_not():
    def foreach_norm(order: str) -> list[dict]:
        return [_cpu("aten::_foreach_norm", 0.0, 1.0, ext=9) | {"args": {"Concrete Inputs": ["", order, ""]}}]

    assert traces.classify("multi_tensor_apply_kernel<LpNormFunctor>", foreach_norm("inf")) == "float8"
    assert traces.classify("multi_tensor_apply_kernel<LpNormFunctor>", foreach_norm("2.")) == "optimizer"


def test_every_class_is_in_the_docstring():
    assert all(label in traces.__doc__ for label in traces.CLASSES.values())


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

    result = run_script("scripts/profile_summary.py", [str(path), "--top", "1000"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no GPU kernels in this trace" in result.stdout.splitlines()[0]
    s = traces.summarize(traces.load_trace(path), top=1000)
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
        (gzip.compress(b"{", mtime=0), "not JSON"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, content, message):
    path = tmp_path / "trace.json"
    if content is not None:
        path.write_bytes(content)
    result = run_script("scripts/profile_summary.py", [str(path)], timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {path}: {message}") and len(result.stderr.splitlines()) == 1
