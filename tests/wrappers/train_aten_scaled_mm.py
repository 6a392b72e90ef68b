"""train.py with CPU `torch._scaled_mm` computed as ATen's own CPU kernel computes it.

Launched in place of train.py by ``run_train(..., script="tests/wrappers/train_aten_scaled_mm.py")``.
torchao's float8 linears call `torch._scaled_mm`, which on CPUs with AMX goes to oneDNN's
reference float8 kernel (about 1,000x slower, docs/float8/library.md "On CPU"): a 2-layer test
step takes seconds per GEMM there. This routes it to `float8.gemm.scaled_mm_cpu`, the
formula our float8 package uses on every CPU, so torchao's casts, scales, FSDP all-gather
and TP styles run as they are and only the GEMM kernel is ATen's.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

from float8.gemm import scaled_mm_cpu

ROOT = Path(__file__).resolve().parents[2]

_original = torch._scaled_mm


def _aten_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    if a.device.type != "cpu" or bias is not None or scale_result is not None:
        return _original(a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
                         use_fast_accum=use_fast_accum)
    return scaled_mm_cpu(a, b, scale_a, scale_b, out_dtype or a.dtype)


torch._scaled_mm = _aten_scaled_mm
sys.argv = [str(ROOT / "train.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
