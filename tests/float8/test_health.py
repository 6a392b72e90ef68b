"""Float8 health metrics (float8/health.py): exact counts on a tiny linear, micro-batch merging,
warnings, the trainer's metrics.jsonl / TensorBoard keys, bitwise-unchanged training, and agreement
between layouts (FSDP=2 with the float8 all-gather, TP=2)."""

from __future__ import annotations

import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from float8 import Float8Config, convert_to_float8_training, health
from float8.health import Float8HealthMonitor
from tests.helpers import read_metrics, run_train

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _linear() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16, bias=False))
    convert_to_float8_training(model, config=Float8Config(scaling="tensorwise", filter_fqns=[]))
    return model


def _x() -> torch.Tensor:
    # Scale 448 / 1000: 1000 and 990 land on 448 (990 * 0.448 = 443.5 rounds up), 950 on 416;
    # 1e-6 * 0.448 is far below e4m3's smallest subnormal (2**-9), so it flushes to zero.
    x = torch.full((4, 16), 0.5)
    x[0, 0], x[0, 1], x[0, 2] = 1000.0, 990.0, 950.0
    x[1, :3] = 1e-6
    x[2, :5] = 0.0  # zeros are not underflow
    return x


def _g() -> torch.Tensor:
    # e5m2 scale 57344 / 2: 2 saturates, 1e-10 * 28672 is below half of e5m2's 2**-16: zero.
    g = torch.full((4, 16), 0.25)
    g[3, 15] = -2.0
    g[0, :2] = 1e-10
    return g


def _step(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    (model(x) * g).sum().backward()


def test_stats_of_a_tiny_linear_are_the_hand_counted_ones():
    model = _linear()
    with torch.no_grad():
        model[0].weight.fill_(0.01)
        model[0].weight[0, 0] = -0.5
    monitor = Float8HealthMonitor(model, torch.device("cpu"))
    monitor.arm()
    _step(model, _x(), _g())
    m = monitor.collect().metrics
    nonzero_x = 64 - 5
    assert m["float8/0/input/amax"] == 1000.0
    assert m["float8/0/input/scale"] == pytest.approx(E4M3_MAX / 1000.0, rel=1e-7)
    assert m["float8/0/input/underflow"] == 3 / nonzero_x
    assert m["float8/0/input/saturation"] == 2 / nonzero_x
    assert m["float8/0/weight/amax"] == 0.5
    assert m["float8/0/weight/underflow"] == 0.0
    assert m["float8/0/weight/saturation"] == 1 / 256
    assert m["float8/0/grad_output/amax"] == 2.0
    assert m["float8/0/grad_output/scale"] == E5M2_MAX / 2.0
    assert m["float8/0/grad_output/underflow"] == 2 / 64
    assert m["float8/0/grad_output/saturation"] == 1 / 64
    # Squared norms: x holds 53 x 0.5**2 + 1000**2 + 990**2 + 950**2 + 3 x 1e-6**2; the flushed
    # 1e-6s hold 3e-12 of it, and 990 cast to the maximum reads back as 1000 (error 10, squared 100).
    x_norm = 53 * 0.25 + 1000.0**2 + 990.0**2 + 950.0**2 + 3e-12
    assert m["float8/0/input/underflow_norm_share"] == pytest.approx(3e-12 / x_norm, rel=1e-5)
    assert m["float8/0/input/saturation_norm_share"] == pytest.approx(100 / x_norm, rel=1e-5)
    # w's -0.5 is its amax: cast to exactly -448, nothing lost; no entry flushes.
    assert m["float8/0/weight/underflow_norm_share"] == 0.0
    assert m["float8/0/weight/saturation_norm_share"] == 0.0
    # g: 61 x 0.25**2 + 2**2 + 2 x 1e-10**2; the 1e-10s flush, -2 is the exact maximum.
    g_norm = 61 * 0.0625 + 4.0 + 2e-20
    assert m["float8/0/grad_output/underflow_norm_share"] == pytest.approx(2e-20 / g_norm, rel=1e-5)
    assert m["float8/0/grad_output/saturation_norm_share"] == 0.0
    assert m["float8/0/input/amax_growth"] == 1.0
    assert m["float8/worst/input/underflow"] == 3 / nonzero_x
    assert m["float8/worst/input/underflow/layer"] == "0"


def test_micro_batches_merge_and_amax_growth_counts_from_the_first_health_step():
    model = _linear()
    monitor = Float8HealthMonitor(model, torch.device("cpu"))
    monitor.arm()
    _step(model, _x(), _g())
    _step(model, _x() / 4, _g())  # a second micro-batch: smaller amax, same counts
    m = monitor.collect().metrics
    assert m["float8/0/input/amax"] == 1000.0
    assert m["float8/0/input/underflow"] == 6 / 118
    assert m["float8/0/input/scale"] == pytest.approx(E4M3_MAX / 1000.0, rel=1e-7)  # the smaller scale
    # Unarmed steps report nothing; the next armed one compares with the first.
    _step(model, _x(), _g())
    monitor.arm()
    _step(model, _x() * 8, _g())
    assert monitor.collect().metrics["float8/0/input/amax_growth"] == 8.0


def test_warnings_fire_on_the_norm_share_once_per_layer_and_operand(monkeypatch):
    # The defaults (1e-3 of the squared norm) are far above these hand-made casts' shares
    # (input 1.0e-18, grad_output 2.6e-21): lowered between the two, only the input warns,
    # although grad_output's count (2 of 64 values, 3 %) is the larger.
    assert health.UNDERFLOW_NORM_WARN == health.SATURATION_NORM_WARN == 1e-3
    monkeypatch.setattr(health, "UNDERFLOW_NORM_WARN", 1e-19)
    model = _linear()
    monitor = Float8HealthMonitor(model, torch.device("cpu"))
    warnings = []
    for _ in range(2):
        monitor.arm()
        _step(model, _x(), _g())
        warnings += monitor.collect().warnings
    assert warnings == ["float8 health: 0 input: 1.04e-18 of its squared norm flushed to zero by the float8 cast "
                        "(5.08% of its non-zero values) (warning threshold 1e-19 of the squared norm; "
                        "docs/float8/trainer.md, 'Is float8 hurting my loss?')"]


@pytest.mark.slow
@pytest.mark.version_specific
def test_arming_leaves_eager_and_compiled_training_bitwise_unchanged():
    def make() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False))
        convert_to_float8_training(model, config=Float8Config(scaling="tensorwise", filter_fqns=[]))
        return model

    x = torch.randn(16, 32)
    for compiled in (False, True):
        plain, probed = make(), make()
        if compiled:
            plain.compile(fullgraph=True)
            probed.compile(fullgraph=True)
        monitor = Float8HealthMonitor(probed, torch.device("cpu"))
        for step in range(3):
            if step == 1:
                monitor.arm()
            for model in (plain, probed):
                model(x).square().sum().backward()
            if step == 1:
                assert not math.isnan(monitor.collect().metrics["float8/2/grad_output/amax"])
            for p, q in zip(plain.parameters(), probed.parameters()):
                assert torch.equal(p.grad, q.grad), (compiled, step)
                for param in (p, q):
                    with torch.no_grad():
                        param -= 1e-3 * param.grad
                    param.grad = None


# Two layers of 64 tokens: every probe, its reduction over ranks and its logging at a sixteenth
# of the debug config's work.
DEBUG = ["--config", "configs/debug.toml", "--float8.enabled", "true", "--training.steps", "4",
         "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
         "--model.n_layers", "2", "--training.seq_len", "64"]


def _run(tmp_path, name: str, *extra: str, nproc: int = 1) -> list[dict]:
    dump = tmp_path / name
    r = run_train([*DEBUG, "--job.dump_folder", str(dump), *extra], nproc=nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_metrics(dump)


@pytest.mark.slow
def test_trainer_logs_health_every_n_steps_without_changing_training(tmp_path):
    plain = _run(tmp_path, "plain")
    probed = _run(tmp_path, "probed", "--metrics.float8_stats_freq", "2", "--metrics.log_freq", "3",
                  "--metrics.enable_tensorboard", "true")
    # log_freq 3 logs steps 1, 3 and 4; the health steps 2 and 4 are logged too.
    assert [r["step"] for r in probed] == [1, 2, 3, 4]
    assert [(r["loss"], r["grad_norm"]) for r in probed] == [(r["loss"], r["grad_norm"]) for r in plain]
    health_steps = [r["step"] for r in probed if any(k.startswith("float8/") for k in r)]
    assert health_steps == [2, 4]
    row = probed[1]
    # 2 layers x 7 linears x 3 operands x 7 quantities, plus the worst of each with its layer.
    assert len([k for k in row if k.startswith("float8/") and "/worst/" not in k]) == 14 * 21
    assert 0 <= row["float8/worst/grad_output/underflow_norm_share"] < 1e-3
    assert row["float8/worst/weight/amax/layer"].startswith("layers.")
    assert row["float8/layers.0.attention.wq/input/amax"] > 0
    acc = EventAccumulator(str(tmp_path / "probed" / "tb" / "debug-tensorwise-none"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "float8/worst/grad_output/underflow" in tags
    assert "float8/worst/grad_output/underflow_norm_share" in tags
    assert "float8/layers.1.feed_forward.w2/grad_output/saturation" in tags
    assert [e.step for e in acc.Scalars("float8/worst/input/amax")] == [2, 4]


@pytest.mark.slow
def test_health_under_activation_checkpointing_and_accumulation_changes_nothing(tmp_path):
    args = ("--activation_checkpoint.mode", "full", "--training.gradient_accumulation_steps", "2",
            "--training.steps", "2")
    plain = _run(tmp_path, "plain", *args)
    probed = _run(tmp_path, "probed", *args, "--metrics.float8_stats_freq", "2")
    assert [(r["loss"], r["grad_norm"]) for r in probed] == [(r["loss"], r["grad_norm"]) for r in plain]
    assert probed[-1]["float8/layers.1.feed_forward.w1/grad_output/amax"] > 0


def _two_rank_worker(rank: int) -> dict:
    model = _linear()
    monitor = Float8HealthMonitor(model, torch.device("cpu"))
    monitor.arm()
    _step(model, _x() * (rank + 1), _g())  # rank 1 holds the larger input amax
    return monitor.collect().metrics


@pytest.mark.slow
def test_collect_reduces_over_ranks(tmp_path):
    from tests.float8.test_distributed import _spawn

    m = _spawn(_two_rank_worker, tmp_path)
    assert m["float8/0/input/amax"] == 2000.0
    assert m["float8/0/input/underflow"] == 6 / 118
    assert m["float8/0/input/saturation"] == 4 / 118
    # Rank 1's x is twice rank 0's: both squared norms grow 1 + 4 times, the share stays.
    x_norm = 53 * 0.25 + 1000.0**2 + 990.0**2 + 950.0**2 + 3e-12
    assert m["float8/0/input/underflow_norm_share"] == pytest.approx(3e-12 / x_norm, rel=1e-5)
    assert m["float8/0/input/scale"] == pytest.approx(E4M3_MAX / 2000.0, rel=1e-7)  # the smaller one


@pytest.mark.slow
@pytest.mark.version_specific
def test_layouts_agree_on_health(tmp_path):
    """Step 1's global batch split over FSDP=2 (float8 all-gather) or TP=2 gives the stats of one rank:
    exactly where no float8 rounding came before, nearly past it (each layout rounds its own way)."""
    args = ("--metrics.float8_stats_freq", "1", "--training.steps", "1")
    single = _run(tmp_path, "dp1", *args)[-1]
    fsdp = _run(tmp_path, "dp2", *args, "--float8.fsdp_float8_all_gather", "true", "--training.batch_size", "2",
                nproc=2)[-1]
    tp = _run(tmp_path, "tp2", *args, "--parallelism.tensor_parallel_degree", "2", nproc=2)[-1]
    first = "float8/layers.0.attention.wq"
    for other, dp in ((fsdp, 2), (tp, 1)):
        assert other["loss"] == pytest.approx(single["loss"], rel=1e-3)
        assert other[f"{first}/input/amax"] == single[f"{first}/input/amax"]
        # FSDP: recovered from the gathered float8 bytes; TP: the largest shard's.
        assert other[f"{first}/weight/amax"] == pytest.approx(single[f"{first}/weight/amax"], rel=1e-6)
        # The last block's w2 gets its output gradient through bf16 ops only; each DP rank's is
        # DP-degree times larger (FSDP averages the gradients). Deeper output gradients pass
        # through e5m2 GEMMs that round per layout: their amaxes are compared by shares only.
        last = "float8/layers.1.feed_forward.w2/grad_output/amax"
        assert other[last] == pytest.approx(dp * single[last], rel=2e-2)
        for name in ("layers.0.attention.wq", "layers.0.feed_forward.w2", "layers.1.attention.wo"):
            for operand in ("input", "weight", "grad_output"):
                key = f"float8/{name}/{operand}"
                if operand != "grad_output":
                    assert other[f"{key}/amax"] == pytest.approx(single[f"{key}/amax"], rel=0.1), key
                assert other[f"{key}/underflow"] == pytest.approx(single[f"{key}/underflow"], abs=2e-3), key
                assert other[f"{key}/saturation"] == pytest.approx(single[f"{key}/saturation"], abs=2e-3), key
