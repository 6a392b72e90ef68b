"""scripts/harness/float8_bench/adamw.py (bench_float8_casts.py --only adamw): every kernel it times
updates the weights (the Triton one launched with the trainer's kernel signature), under Triton's
interpreter on CPU tensors (tiny weights; the GPU run times LLaMA-2-7B's)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.version_specific


def test_every_timed_kernel_updates_the_weights(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernel in Triton's interpreter (tests/conftest.py sets it without a GPU)")
    pytest.importorskip("triton")
    from scripts.harness.float8_bench import adamw

    monkeypatch.setattr(adamw, "SHAPES", [(30, 7), (5000,)])
    monkeypatch.setattr(adamw, "BLOCKS", (1024,))
    monkeypatch.setattr(adamw, "WARPS", (4,))
    cells, weights = adamw.kernels(torch.device("cpu"))
    assert [name for name, _ in cells] == ["AdamW torch fused", "AdamW triton 1024 x 4 warps"]
    for name, update in cells:
        before = [w.clone() for w in weights]
        update()
        assert all(not torch.equal(a, b) for a, b in zip(before, weights)), name
