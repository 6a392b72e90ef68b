"""scripts/harness/float8_bench/host.py (bench_float8_casts.py --only host): every call it times casts
to float8, under Triton's interpreter on CPU tensors (the GPU run times the host)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.version_specific


def test_every_timed_call_casts():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in Triton's interpreter (tests/conftest.py sets it without a GPU)")
    pytest.importorskip("triton")
    from scripts.harness.float8_bench import host

    for name, call in host.calls(torch.device("cpu")):
        data = call()[0]
        assert data.dtype == torch.float8_e4m3fn and data.shape == host.SHAPE and data.float().abs().max() > 0, name
