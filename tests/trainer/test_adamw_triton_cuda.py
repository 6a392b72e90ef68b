"""trainer/adamw_triton.py on a GPU: torch's fused AdamW to fp32 rounding on 7B-sized and odd-sized
parameters, the fused guard (`grad_scale`, `found_inf`) and the weights' amaxes. Skipped without CUDA;
tests/trainer/test_adamw_triton.py is the CPU side (Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(11008, 4096), (4096,), (1000, 3)]


def test_triton_adamw_is_torchs_fused_adamw_on_cuda():
    from trainer.adamw_triton import TritonAdamW

    gen = torch.Generator(device="cuda").manual_seed(0)
    start = [torch.randn(s, device="cuda", generator=gen) for s in SHAPES]
    ref, tri = ([p.clone().requires_grad_() for p in start] for _ in range(2))
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ref_opt, tri_opt = torch.optim.AdamW(ref, fused=True, **hyper), TritonAdamW(tri, **hyper)
    for step in range(3):
        grads = [torch.randn(s, device="cuda", generator=gen) for s in SHAPES]
        guard = {"grad_scale": torch.tensor(2.0, device="cuda"), "found_inf": torch.tensor(float(step == 2), device="cuda")}
        for opt, params in ((ref_opt, ref), (tri_opt, tri)):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.grad_scale, opt.found_inf = guard["grad_scale"], guard["found_inf"]
            opt.step()
        for a, b in zip(ref, tri):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(tri_opt.weight_amaxes()[p], p.detach().abs().max()) for p in tri)
    assert float(tri_opt.state[tri[0]]["step"]) == float(ref_opt.state[ref[0]]["step"]) == 2


def test_rows_and_columns_amaxes_of_weights_read_as_stored_on_cuda():
    from float8.fsdp import Float8TrainingWeight
    from trainer.adamw_triton import TritonAdamW

    gen = torch.Generator(device="cuda").manual_seed(0)
    start = [torch.randn(s, device="cuda", generator=gen) for s in [(11008, 4096), (4096, 11008), (1000, 48)]]
    ref = [p.clone().requires_grad_() for p in start]
    tri = [Float8TrainingWeight(p.clone(), as_stored=True).requires_grad_() for p in start]
    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ref_opt, tri_opt = torch.optim.AdamW(ref, fused=True, **hyper), TritonAdamW(tri, **hyper)
    for opt, params in ((ref_opt, ref), (tri_opt, tri)):
        for p, g in zip(params, start):
            p.grad = g.flip(0).clone()
        opt.step()
    for a, b in zip(ref, tri):
        torch.testing.assert_close(a, b.detach()._tensor, rtol=1e-6, atol=1e-6)
        w = b.detach()._tensor.abs()
        assert torch.equal(tri_opt.weight_amaxes()[b], torch.cat([w.amax(1), w.amax(0)]))
