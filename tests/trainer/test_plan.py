"""trainer/plan.py: the run resolved once; the Trainer builds from the plan and the dry run prints it."""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch

from models.llama import num_params
from tests.helpers import ROOT
from trainer.config import build_config
from trainer.dry_run import plan_lines, print_plan
from trainer.errors import UserError
from trainer.model_setup import build_meta_model
from trainer.plan import RunPlan


def _plan(*args: str, world_size: int = 1) -> tuple:
    cfg = build_config(["--config", "configs/debug.toml", "--training.device", "cpu", *args])
    return cfg, RunPlan.resolve(cfg, world_size, load_tokenizer=False)


@pytest.mark.parametrize("args", [[], ["--model.n_layers", "2"], ["--model.flavor", "7B", "--model.n_layers", "1"]])
def test_the_plan_counts_the_parameters_the_model_has(args):
    _, plan = _plan(*args)
    model = build_meta_model(plan.model_args)
    assert plan.facts.n_params == num_params(model)
    assert plan.params_without_embedding == num_params(model, exclude_embedding=True)


@pytest.mark.parametrize(("args", "run_name", "summary", "dry_run"), [
    ([], "fp32", "params float32 (set in the config)", "float32; params float32 (set in the config), reduce float32"),
    (["--float8.enabled", "true", "--float8.scaling", "rowwise"], "rowwise",
     "float8 rowwise, params float32 (set in the config)",
     "float8 rowwise; params float32 (set in the config), reduce float32"),
])
def test_the_precision_label_is_built_once_for_every_output(args, run_name, summary, dry_run):
    _, plan = _plan("--training.mixed_precision_param", "float32", *args)
    assert (plan.precision.run_name, plan.precision.summary, plan.precision.plan) == (run_name, summary, dry_run)
    assert plan.facts.precision == run_name and plan.facts.run_name == f"debug-{run_name}-none"


def test_the_plan_is_frozen_and_holds_the_layout():
    _, plan = _plan("--parallelism.tensor_parallel_degree", "2", world_size=4)
    assert (plan.facts.world_size, plan.facts.dp, plan.facts.tp, plan.vocab_sharded_logits) == (4, 2, 2, True)
    assert plan.fast_path.text is None and plan.tokenizer is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.device_type = "cuda"


def test_the_trainer_loads_the_tokenizer_into_the_plan():
    cfg = build_config(["--config", "configs/debug.toml", "--training.device", "cpu"])
    plan = RunPlan.resolve(cfg, 1)
    assert plan.tokenizer is not None and plan.tokenizer.n_words <= plan.model_args.vocab_size


def test_the_dry_run_prints_the_plan(monkeypatch, capsys):
    resolved = []
    resolve = RunPlan.resolve

    def recording(*args, **kwargs):
        resolved.append(resolve(*args, **kwargs))
        return resolved[-1]

    monkeypatch.setattr(RunPlan, "resolve", staticmethod(recording))
    cfg = build_config(["--config", "configs/debug.toml", "--training.device", "cpu", "--float8.enabled", "true",
                        "--float8.emulate", "true"])
    print_plan(cfg)
    out = capsys.readouterr().out
    [plan] = resolved
    assert plan.float8.report is not None  # the dry run converted its meta model with the plan's seam
    lines = plan_lines(cfg, plan, [])
    assert all(line in out for line in lines)
    assert f"  precision         {plan.precision.plan}" in lines
    assert f"  memory estimate   {plan.memory.summary()}" in lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without CUDA")
def test_a_plan_for_cuda_without_cuda_is_one_line():
    cfg = build_config(["--config", "configs/debug.toml", "--training.device", "cuda"])
    with pytest.raises(UserError, match=r"^training.device = 'cuda' but no CUDA device is available$"):
        RunPlan.resolve(cfg, 1, load_tokenizer=False)


# What a run's facts are derived from: called in trainer/ by the plan only (and by inference.py,
# which builds one plain model from a trained run's config for generate.py, not a training run).
RESOLVERS = {"resolve_param_precision", "model_args_for", "check_layout", "build_seam", "choose_fast_path",
             "estimate_for", "flops_per_token", "Tokenizer", "run_name_precision", "plan_precision"}


def test_the_run_is_resolved_in_one_place():
    calls = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in ("trainer/plan.py", "trainer/inference.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in RESOLVERS:
                    calls.append(f"{relative}:{node.lineno} {name}")
    assert calls == []
