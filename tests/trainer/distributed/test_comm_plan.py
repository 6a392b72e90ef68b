"""The dry run's communication plan against hand arithmetic: the debug model and LLaMA-2-7B at FSDP 8, HSDP 2x8
and FSDP 4 x TP 2 (trainer/distributed/comm_plan.py says what a step moves; bytes are ring bus bytes)."""

import pytest

from trainer.config import Layout, build_config
from trainer.distributed.comm_plan import StepShape, comm_plan, group_spans_nodes
from trainer.dry_run import print_plan
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import build_seam
from trainer.model_setup import build_meta_model, model_args_for

# LLaMA-2-7B: dim, FFN, vocab, layers; 6,738,415,616 parameters.
D, H, V, L = 4096, 11008, 32000, 32
P = L * (4 * D * D + 3 * D * H + 2 * D) + 2 * V * D + D
# configs/7b_fp8.toml on a GPU: bf16 parameters, fp32 reduction, batch 2 x seq 4096, no accumulation.
SHAPE_7B = StepShape(tokens=2 * 4096, grad_accum=1, param_bytes=2, reduce_bytes=4, reshard_after_forward=True,
                     tp_float8=True, loss_parallel=True, ac_mode="none", ac_option="op")


def _plan_7b(layout: Layout, nproc_per_node: int = 8) -> dict[str, tuple[str, int, float, bool]]:
    cfg = build_config(["--config", "configs/7b_fp8.toml"])
    model = build_meta_model(model_args_for(cfg, None, "cpu"))
    seam = build_seam(cfg.float8, Float8RunContext.for_run(cfg, "cuda", "bfloat16"))
    seam.convert(model, time_linears=False)
    rows = comm_plan(model, layout, SHAPE_7B, seam.gathered_in_float8(), nproc_per_node)
    return {r.what: (r.dim, r.ranks, r.bytes, r.crosses_nodes) for r in rows}


def _fsdp_7b(tp: int) -> tuple[float, float]:
    """(bytes one step all-gathers, bytes it reduce-scatters), before the ring factor: the 7 linears of each
    block gathered in float8 (1 byte), norms, embedding and output in bf16; TP splits all but the norms."""
    block = (4 * D * D + 3 * D * H) // tp + 2 * 2 * D
    root = 2 * (2 * V * D // tp) + 2 * D
    gathered = L * block + root + (L - 1) * block  # backward re-gathers every block but the last
    elements = L * ((4 * D * D + 3 * D * H) // tp + 2 * D) + 2 * V * D // tp + D
    return gathered, 4 * elements


def test_7b_fsdp_8():
    gathered, reduced = _fsdp_7b(tp=1)
    assert P == 6_738_415_616
    assert _plan_7b(Layout(1, 8, 1)) == {
        "FSDP all-gather, weights (forward + backward)": ("dp_shard", 8, gathered * 7 / 8, False),
        "FSDP reduce-scatter, gradients": ("dp_shard", 8, reduced * 7 / 8, False),
        "float8 weight scales, all-reduce": ("dp_shard", 8, 224 * 4 * 2 * 7 / 8, False),
    }
    assert gathered * 7 / 8 == pytest.approx(11.616e9, rel=1e-4)  # the table in docs/parallelism.md


def test_7b_hsdp_2x8_keeps_all_but_one_all_reduce_on_the_node():
    gathered, reduced = _fsdp_7b(tp=1)
    assert _plan_7b(Layout(2, 8, 1)) == {
        "FSDP all-gather, weights (forward + backward)": ("dp_shard", 8, gathered * 7 / 8, False),
        "FSDP reduce-scatter, gradients": ("dp_shard", 8, reduced * 7 / 8, False),
        # 1/8 of the fp32 gradients, all-reduced over 2 replicas: 2 x (1/2) x 4 P / 8 bytes
        "HSDP all-reduce, gradient shards": ("dp_replicate", 2, P / 2, True),
        "float8 weight scales, all-reduce": ("dp_shard", 8, 224 * 4 * 2 * 7 / 8, False),
    }
    # FSDP over the same 16 GPUs sends every all-gather and reduce-scatter across the nodes.
    fsdp16 = _plan_7b(Layout(1, 16, 1))
    assert fsdp16["FSDP reduce-scatter, gradients"] == ("dp_shard", 16, reduced * 15 / 16, True)


def test_7b_fsdp_4_tp_2():
    gathered, reduced = _fsdp_7b(tp=2)
    tokens = 2 * 4096
    assert _plan_7b(Layout(1, 4, 2)) == {
        "FSDP all-gather, weights (forward + backward)": ("dp_shard", 4, gathered * 3 / 4, False),
        "FSDP reduce-scatter, gradients": ("dp_shard", 4, reduced * 3 / 4, False),
        "float8 weight scales, all-reduce": ("dp_shard", 4, 224 * 4 * 2 * 3 / 4, False),
        # Per block 2 float8 all-gathers forward, 2 (e5m2) backward; the root's 2 in bf16.
        "TP all-gather, activations": ("tp", 2, tokens * D * (4 * L * 1 + 2 * 2) / 2, False),
        # Per block 2 forward, 2 backward (the all-gathers' gradients), the root's 2, all bf16.
        "TP reduce-scatter, activations": ("tp", 2, tokens * D * (4 * L * 2 + 2 * 2) / 2, False),
        "TP all-reduce, norm weight gradients": ("tp", 2, (2 * L + 1) * D * 2 * 2 / 2, False),
        "TP float8 amax, all-reduce": ("tp", 2, 4 * L * 4 * 2 / 2, False),
        "TP loss parallel, all-reduce": ("tp", 2, tokens * 3 * 4 * 2 / 2, False),
    }


def test_debug_model_tp_with_recompute_accumulation_and_whole_logits():
    cfg = build_config(["--config", "configs/debug.toml"])
    model = build_meta_model(model_args_for(cfg, None, "cpu"))
    shape = StepShape(tokens=8 * 64, grad_accum=2, param_bytes=4, reduce_bytes=4, reshard_after_forward=True,
                      tp_float8=False, loss_parallel=False, ac_mode="full", ac_option="op")
    rows = {r.what: (r.dim, r.ranks, r.bytes, r.crosses_nodes) for r in comm_plan(model, Layout(1, 2, 2), shape, set(), 2)}
    # dim 256, 128 KV columns, FFN 768, vocab 2048, 4 layers; TP 2 splits the linears, embedding and output.
    block = (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 768) // 2 + 2 * 256
    root = 2048 * 256 + 256
    # Two micro-batches all-gather (forward 4 blocks + root, backward 3 blocks), fp32; one reduce-scatter.
    # TP per token x dim, fp32: every block's 2 forward all-gathers again in the recompute and its first
    # reduce-scatter (the recompute stops before the second), 2 each way in backward, the root's 2 each way.
    tokens = 8 * 64 * 2
    assert rows == {
        "FSDP all-gather, weights (forward + backward)": ("dp_shard", 2, 2 * 4 * (4 * block + root + 3 * block) / 2, True),
        "FSDP reduce-scatter, gradients": ("dp_shard", 2, 4 * (4 * block + root) / 2, True),
        "TP all-gather, activations": ("tp", 2, tokens * 256 * 4 * (8 + 8 + 8 + 2) / 2, False),
        "TP reduce-scatter, activations": ("tp", 2, tokens * 256 * 4 * (8 + 4 + 8 + 2) / 2, False),
        "TP all-reduce, norm weight gradients": ("tp", 2, 2 * (2 * 4 + 1) * 256 * 4 * 2 / 2, False),
        "TP all-gather, logits": ("tp", 2, tokens * 2048 * 4 / 2, False),
    }


def test_which_groups_span_nodes():
    # 16 ranks = replicate 2 x shard 4 x TP 2, 8 per node: TP pairs and shard groups stay on a node.
    layout = Layout(2, 4, 2)
    assert [group_spans_nodes(layout, dim, 8) for dim in ("tp", "dp_shard", "dp_replicate")] == [False, False, True]
    assert [group_spans_nodes(layout, dim, 4) for dim in ("tp", "dp_shard", "dp_replicate")] == [False, True, True]
    assert not group_spans_nodes(layout, "dp_replicate", 16)


def test_dry_run_prints_the_3d_mesh_and_what_crosses_nodes(capsys):
    cfg = build_config(["--config", "configs/7b_fp8.toml", "--job.dry_run_world_size", "16",
                        "--job.dry_run_nproc_per_node", "8", "--parallelism.data_parallel_replicate_degree", "2"])
    print_plan(cfg)
    out = capsys.readouterr().out
    assert "  layout            world 16 = dp 16 (HSDP: replicate 2 x shard 8) x tp 1\n" in out
    assert "per GPU per step (bus bytes), 8 GPUs per node:" in out
    line = next(line for line in out.splitlines() if "HSDP all-reduce" in line)
    assert line.split()[-5:] == ["x2", "3.37", "GB", "across", "nodes"], line
