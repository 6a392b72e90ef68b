"""scripts/harness/float8_bench/packing.py (bench_float8_casts.py --only packing): both packings it times
write the same buffer at each rank count (tiny gradients on CPU; the GPU run times a LLaMA-2-7B block's)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.version_specific


def test_both_timed_packings_write_the_same_buffer(monkeypatch):
    from scripts.harness.float8_bench import packing

    monkeypatch.setattr(packing, "SHAPES", [(10, 3), (4,), (9, 2, 2)])
    monkeypatch.setattr(packing, "RANKS", (1, 4))
    cells, n_params = packing.kernels(torch.device("cpu"))
    assert n_params == 30 + 4 + 36
    assert [(name, ranks) for name, ranks, _, _ in cells] == [("chunk_cat", 1), ("copies", 1), ("chunk_cat", 4), ("copies", 4)]
    for (_, _, pack_fsdp, fsdp_buffer), (_, _, pack_ours, our_buffer) in zip(cells[::2], cells[1::2]):
        fsdp_buffer.fill_(float("nan"))
        our_buffer.fill_(float("nan"))
        pack_fsdp()
        pack_ours()
        assert torch.equal(fsdp_buffer, our_buffer)
