"""trainer/float8_seam/: the trainer's one float8 seam (ours and off here; torchao: test_reference.py),
and one default per float8 setting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from float8 import RECIPES, Float8Config, Float8Linear
from float8.tp import Float8ColwiseParallel
from models.llama import LLAMA2_FLAVORS
from trainer.config import Config, Float8TrainingConfig
from trainer.distributed.memory_plan import Float8Memory
from trainer.distributed.parallelize import PLAIN_TP_STYLES
from trainer.float8_seam import ours as float8_training
from trainer.float8_seam.off import NoFloat8Training
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import Float8Seam, build_seam, float8_memory
from trainer.model_setup import build_meta_model

CPU = torch.device("cpu")


def _cfg(**float8: object) -> Config:
    cfg = Config()
    cfg.float8.enabled = True
    cfg.compile.mode = "block"
    for key, value in float8.items():
        setattr(cfg.float8, key, value)
    return cfg


def _seam(cfg: Config, device_type: str = "cpu") -> Float8Seam:
    return build_seam(cfg.float8, Float8RunContext.for_run(cfg, device_type, cfg.training.mixed_precision_param))


# Trainer-only keys: `enabled`; `filter`, whose "auto" needs the run's device, tokens and compile mode;
# `cast_weights_once`, an argument of the post-step call; `impl`, which package the seam runs.
TRAINER_ONLY_FLOAT8_KEYS = ("enabled", "filter", "cast_weights_once", "impl")


def test_trainer_and_package_share_every_float8_default():
    package = Float8Config()
    for f in dataclasses.fields(Float8TrainingConfig):
        if f.name not in TRAINER_ONLY_FLOAT8_KEYS:
            trainer_default, package_default = getattr(Float8TrainingConfig(), f.name), getattr(package, f.name)
            if isinstance(package_default, tuple):  # the frozen config's lists are tuples
                trainer_default = tuple(trainer_default)
            assert trainer_default == package_default, f.name
    assert dataclasses.fields(Float8TrainingConfig)[1].metadata["choices"] == tuple(RECIPES)


@pytest.mark.parametrize("scaling, fast_path, as_stored", [
    ("rowwise", True, True), ("rowwise_gw_hp", True, True), ("rowwise", False, False), ("tensorwise", True, False),
])
def test_weights_cast_per_row_are_read_as_stored_on_the_one_gpu_fast_path(scaling, fast_path, as_stored):
    cfg = _cfg(scaling=scaling)
    seam = build_seam(cfg.float8, Float8RunContext.for_run(cfg, "cpu", "bfloat16", single_rank_fast_path=fast_path))
    model = build_meta_model(LLAMA2_FLAVORS["debug"])
    seam.convert(model)
    weight = model.layers["0"].attention.wq.weight
    assert getattr(weight, "_as_stored", False) is as_stored


def test_float8_off_is_a_seam_that_does_nothing():
    seam = _seam(Config())
    assert isinstance(seam, NoFloat8Training)
    model = build_meta_model(LLAMA2_FLAVORS["debug"])
    assert seam.convert(model) is None
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    assert seam.tp_styles() is PLAIN_TP_STYLES
    assert seam.advice(CPU, dp_degree=2, tp_degree=2) == []
    assert seam.describe("params float32") == "params float32" and seam.summary_lines() == []
    seam.post_optimizer_step(model)


def test_convert_reports_and_keeps_the_output_layer_in_high_precision():
    seam = _seam(_cfg())
    model = build_meta_model(LLAMA2_FLAVORS["debug"])
    report = seam.convert(model)
    assert len(report.converted) == 4 * 7 and report.skipped == [("output", "filtered by filter_fqns")]
    assert isinstance(model.layers["0"].attention.wq, Float8Linear)
    assert seam.summary_lines() == [f"float8: {report}"]
    assert seam.describe("params float32") == "float8 tensorwise, params float32"


@pytest.mark.version_specific
@pytest.mark.parametrize(
    ("scaling", "float8_tp", "float8_styles"),
    [("tensorwise", True, True), ("tensorwise", False, False), ("rowwise", True, False)],
)
def test_tp_styles_follow_the_recipe_and_the_switch(scaling, float8_tp, float8_styles):
    cfg = _cfg(scaling=scaling)
    cfg.parallelism.float8_tensor_parallel = float8_tp
    styles = _seam(cfg).tp_styles()
    assert (styles.colwise is Float8ColwiseParallel) == float8_styles
    assert styles.local_inputs == float8_styles


@pytest.mark.version_specific
def test_float8_tp_styles_fall_back_where_torch_miscompiles_them(monkeypatch):
    cfg = _cfg()
    cfg.training.mixed_precision_param = "float32"
    monkeypatch.setattr(float8_training.torch, "__version__", "2.11.0+cu130")
    seam = _seam(cfg)
    assert seam.tp_styles() is PLAIN_TP_STYLES
    notes = seam.advice(CPU, dp_degree=1, tp_degree=2)
    assert [n for n in notes if "miscompiles the float8 tensor-parallel styles" in n]
    assert not [n for n in seam.advice(CPU, dp_degree=1, tp_degree=1) if "miscompiles" in n]
    cfg.training.mixed_precision_param = "bfloat16"
    assert _seam(cfg).tp_styles().colwise is Float8ColwiseParallel
    monkeypatch.setattr(float8_training.torch, "__version__", "2.13.0+cpu")
    cfg.training.mixed_precision_param = "float32"
    assert _seam(cfg).tp_styles().colwise is Float8ColwiseParallel
    cfg.compile.mode = "none"
    monkeypatch.setattr(float8_training.torch, "__version__", "2.11.0")
    assert _seam(cfg).tp_styles().colwise is Float8ColwiseParallel


@pytest.mark.parametrize(("scaling", "precomputes"), [("tensorwise", True), ("rowwise", False)])
def test_post_optimizer_step_precomputes_scales_only_for_the_float8_all_gather(monkeypatch, scaling, precomputes):
    calls = []
    monkeypatch.setattr(float8_training, "precompute_float8_scales_for_fsdp",
                        lambda model, cast_weights, amaxes: calls.append((model, cast_weights, amaxes)))
    seam = _seam(_cfg(scaling=scaling, fsdp_float8_all_gather=True))
    # A rowwise recipe cannot gather its weights in float8: the setting is dropped (and advised about).
    assert seam.config.fsdp_float8_all_gather == precomputes
    model = torch.nn.Linear(16, 16)
    amaxes = {model.weight: torch.ones(())}  # the optimizer's, handed on
    seam.post_optimizer_step(model, amaxes)
    assert calls == ([(model, True, amaxes)] if precomputes else [])
    _seam(_cfg(scaling=scaling, fsdp_float8_all_gather=True, cast_weights_once=False)).post_optimizer_step(model)
    assert calls[1:] == ([(model, False, None)] if precomputes else [])
    _seam(_cfg(scaling=scaling)).post_optimizer_step(model)
    assert len(calls) == 2 * int(precomputes)


@pytest.mark.version_specific
@pytest.mark.parametrize(("device_type", "raised"), [("cuda", True), ("cpu", False)])
def test_the_recompile_limit_is_raised_by_the_seam_and_said(device_type, raised):
    with torch._dynamo.config.patch(recompile_limit=8):
        seam = _seam(_cfg(), device_type)
        seam.convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
        assert torch._dynamo.config.recompile_limit == (64 if raised else 8)
    said = [line for line in seam.summary_lines() if "recompile_limit raised from 8 to 64" in line]
    assert len(said) == int(raised)


def test_float8_eager_casts_reach_the_float8_package():
    import typing

    from float8.operands import EAGER_CASTS
    from trainer.config import build_config
    from trainer.config.schema import Float8EagerCasts

    assert typing.get_args(Float8EagerCasts) == EAGER_CASTS
    assert float8_training.float8_config(build_config(["--float8.eager_casts", "plain"]).float8).eager_casts == "plain"


@pytest.mark.parametrize(
    ("args", "run_name", "plan", "summary"),
    [
        ({"enabled": False}, "fp32", "float32", "params float32"),
        ({"scaling": "rowwise"}, "rowwise", "float8 rowwise", "float8 rowwise, params float32"),
        ({"impl": "torchao"}, "tensorwise-torchao", "float8 tensorwise (torchao)", "float8 tensorwise (torchao 9.9), "),
    ],
)
def test_the_seam_says_the_precision_of_the_run(monkeypatch, args, run_name, plan, summary):
    """One place per implementation for the run name's, the dry run's and the startup summary's precision."""
    monkeypatch.setattr("trainer.float8_seam.reference.torchao_version", lambda asked_by: "9.9")  # no torchao import
    seam = _seam(_cfg(**args))
    assert seam.run_name_precision("float32") == run_name
    assert seam.plan_precision("float32") == plan
    assert seam.describe("params float32").startswith(summary)


@pytest.mark.parametrize(
    ("args", "memory"),
    [
        ({"enabled": False, "fsdp_float8_all_gather": True}, Float8Memory()),
        ({"fsdp_float8_all_gather": True}, Float8Memory(linears=True, kept_shards=True)),
        ({"fsdp_float8_all_gather": True, "cast_weights_once": False}, Float8Memory(linears=True)),
        ({"fsdp_float8_all_gather": True, "scaling": "rowwise"}, Float8Memory(linears=True)),
        # torchao casts each weight shard at every all-gather: nothing kept between steps.
        ({"fsdp_float8_all_gather": True, "impl": "torchao"}, Float8Memory(linears=True)),
    ],
)
def test_the_memory_estimate_asks_the_seam_what_float8_costs(args, memory):
    assert float8_memory(_cfg(**args).float8) == memory


@pytest.mark.parametrize(("scaling", "impl", "kept"), [
    ("rowwise", "ours", True), ("rowwise_gw_hp", "ours", True), ("tensorwise", "ours", False), ("rowwise", "torchao", False),
])
def test_weights_read_as_stored_keep_their_transposed_bytes_for_the_backward(scaling, impl, kept):
    # On the one-GPU fast path ours casts rowwise weights for both GEMMs in the forward (float8/linear.py).
    f8 = _cfg(scaling=scaling, impl=impl).float8
    assert float8_memory(f8, single_rank_fast_path=True).weights_for_backward is kept
    assert not float8_memory(f8).weights_for_backward
