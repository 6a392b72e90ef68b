"""`[float8] impl = "torchao"` (trainer/float8_seam/reference.py): the trainer on the reference library.

The runs use float32 parameters (the same on every CPU) and route torchao's `torch._scaled_mm`
to ATen's CPU formula (tests/wrappers/train_aten_scaled_mm.py), which our package uses on CPU anyway:
on CPUs with AMX torch would run oneDNN's reference float8 kernel, seconds per GEMM.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from float8 import Float8Linear
from models.llama import LLAMA2_FLAVORS
from tests.helpers import ROOT, read_metrics, run_train
from trainer.config import Config, build_config
from trainer.distributed.parallelize import PLAIN_TP_STYLES
from trainer.errors import UserError
from trainer.float8_seam import rules
from trainer.float8_seam.reference import ReferenceMissing, TorchaoFloat8Training, torchao_config
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import build_seam
from trainer.model_setup import build_meta_model

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="needs torchao: pip install -e '.[reference]'")

STEPS = 8
BASE = [
    "--model.n_layers", "2", "--training.seq_len", "64", "--training.steps", str(STEPS),
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
    "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "1e-3", "--training.mixed_precision_param", "float32",
    "--float8.enabled", "true",
]
TORCHAO = ["--float8.impl", "torchao"]
WRAPPER = "tests/wrappers/train_aten_scaled_mm.py"


def _run(tmp_path, name: str, args: list[str], nproc: int = 1, script: str = WRAPPER) -> tuple[list, str, str]:
    """(per-step (loss, grad_norm), stdout, stderr) of a run that must succeed."""
    dump = tmp_path / name
    result = run_train([*BASE, "--job.dump_folder", str(dump), *args], nproc=nproc, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in rows], result.stdout, result.stderr


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _assert_close(a: list, b: list, rtol: float, label: str) -> None:
    """As tests/trainer/distributed/test_parallel.py: losses within rtol, grad norms too at step 1 and 10x rtol after."""
    for step, ((loss_a, norm_a), (loss_b, norm_b)) in enumerate(zip(a, b), start=1):
        assert _rel(loss_a, loss_b) <= rtol, f"{label}: step {step} loss {loss_a} vs {loss_b}"
        assert _rel(norm_a, norm_b) <= (rtol if step == 1 else 10 * rtol), f"{label}: step {step} grad_norm"


def _seam(cfg: Config, device_type: str = "cpu"):
    return build_seam(cfg.float8, Float8RunContext.for_run(cfg, device_type, "float32"))


def _cfg(*args: str) -> Config:
    return build_config(["--float8.enabled", "true", "--float8.impl", "torchao", *args])


def _torchao_version() -> str:
    import torchao

    return torchao.__version__


# -- the trainer on torchao, against ours ------------------------------------------------------------


@needs_torchao
@pytest.mark.slow
def test_torchao_trains_and_matches_ours(tmp_path):
    args = ["--training.batch_size", "8"]
    theirs, out, err = _run(tmp_path, "torchao", [*args, *TORCHAO])
    ours, _, _ = _run(tmp_path, "ours", args, script="train.py")
    version = _torchao_version()
    assert "run debug-tensorwise-torchao-none" in out
    assert f"precision float8 tensorwise (torchao {version}), params float32" in out
    assert f"float8 (torchao {version}): 14 converted (wq, wk, wv, wo, w1, w2, w3 x2); 1 skipped: output" in out
    assert "Traceback" not in err
    assert theirs[-1][0] < theirs[0][0] - 2.0, f"loss did not fall: {theirs}"
    # Same weights and batch at step 1, and the same casts up to rounding: measured (seeds 1, 7, 42,
    # 10 steps) step 1 within 1.2e-5 (loss) and 4.2e-4 (grad norm), every later loss within 2.4e-3.
    # A high-precision forward is 3e-4 to 1e-3 off float8's at step 1, so 1e-4 tells them apart.
    assert _rel(theirs[0][0], ours[0][0]) <= 1e-4, (theirs[0], ours[0])
    assert _rel(theirs[0][1], ours[0][1]) <= 5e-3, (theirs[0], ours[0])
    _assert_close(theirs, ours, 1e-2, "torchao vs ours")


@needs_torchao
@pytest.mark.slow
def test_torchao_fsdp_float8_all_gather_matches_one_process(tmp_path):
    all_gather = [*TORCHAO, "--float8.fsdp_float8_all_gather", "true"]
    single, _, _ = _run(tmp_path, "single", ["--training.batch_size", "8", *all_gather])
    fsdp, out, _ = _run(tmp_path, "fsdp", ["--training.batch_size", "4", *all_gather], nproc=2)
    assert "mesh dp=2 tp=1" in out
    # The default cast_weights_once is ours only: said once, not refused.
    assert "float8.cast_weights_once is ours only (ignored)" in out
    # Measured: losses within 1.2e-3, step-1 grad norm 4.7e-4, later grad norms up to 4.7e-2.
    _assert_close(fsdp, single, 1e-2, "torchao FSDP=2 with float8 all-gather vs 1 process")


@needs_torchao
@pytest.mark.slow
def test_torchao_tensor_parallel_on_cpu_gathers_in_high_precision(tmp_path):
    # torchao's float8 TP styles all-gather float8 dtypes, which gloo refuses ("Invalid scalar
    # type"): on CPU the seam takes torch's plain styles and says so.
    single, _, _ = _run(tmp_path, "single", ["--training.batch_size", "8", *TORCHAO])
    tp, _, err = _run(tmp_path, "tp", ["--training.batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                                       *TORCHAO], nproc=2)
    assert "float8 tensor-parallel styles all-gather float8 dtypes, which gloo cannot" in err
    _assert_close(tp, single, 1e-2, "torchao TP=2 vs 1 process")


# -- refusals: one line, exit 2 ---------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--float8.filter", "auto"], "float8.filter = 'auto' times this repository's float8 linears, not torchao's: "
                                  "with float8.impl = 'torchao' set float8.filter = 'rules'"),
    (["--metrics.float8_stats_freq", "5"], "metrics.float8_stats_freq = 5: float8 health comes from this "
                                           "repository's float8 casts, torchao's report none"),
])
def test_options_of_ours_only_are_refused(args, message):
    with pytest.raises(UserError, match=f"^{re.escape(message)}"):
        _cfg(*args)
    # With ours, or with float8 off, they stand.
    build_config(["--float8.enabled", "true", *args])
    build_config(["--float8.impl", "torchao", *args])
    result = run_train([*TORCHAO, "--float8.enabled", "true", *args])
    assert result.returncode == 2 and result.stderr.startswith(f"error: {message}")
    assert len(result.stderr.strip().splitlines()) == 1


def test_missing_torchao_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` raise ImportError
    with pytest.raises(ReferenceMissing) as error:
        _seam(_cfg())
    assert isinstance(error.value, UserError)
    assert str(error.value).startswith("float8.impl = 'torchao' needs the reference library torchao (")
    assert str(error.value).endswith('pip install -e ".[reference]"') and "\n" not in str(error.value)
    # End to end: a torchao package that cannot be imported, ahead of the installed one.
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("raise ImportError('No module named torchao')\n")
    result = run_train([*BASE, *TORCHAO, "--job.dump_folder", str(tmp_path / "run")], env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == ("error: float8.impl = 'torchao' needs the reference library torchao "
                                     '(No module named torchao): pip install -e ".[reference]"')


@pytest.mark.slow
def test_ours_never_imports_torchao():
    code = textwrap.dedent("""
        import sys
        import scripts.compare_throughput, trainer.dry_run, trainer.trainer
        from models.llama import LLAMA2_FLAVORS
        from trainer.config import build_config
        from trainer.float8_seam.rules import Float8RunContext
        from trainer.float8_seam.seam import build_seam
        from trainer.model_setup import build_meta_model
        cfg = build_config(["--float8.enabled", "true"])
        seam = build_seam(cfg.float8, Float8RunContext.for_run(cfg, "cpu", "float32"))
        seam.convert(build_meta_model(LLAMA2_FLAVORS["debug"]))
        seam.tp_styles(), seam.post_optimizer_step(None)
        assert "torchao" not in sys.modules, "torchao imported"
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -- the seam's methods -----------------------------------------------------------------------------


@needs_torchao
def test_converts_the_linears_ours_converts():
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    cfg = _cfg("--float8.filter_fqns", "output,w2", "--float8.min_features", "200")
    seam = _seam(cfg)
    assert isinstance(seam, TorchaoFloat8Training)
    model = build_meta_model(LLAMA2_FLAVORS["debug"])
    report = seam.convert(model)
    ours_cfg = build_config(["--float8.enabled", "true", "--float8.filter_fqns", "output,w2",
                             "--float8.min_features", "200"])
    ours_model = build_meta_model(LLAMA2_FLAVORS["debug"])
    ours = _seam(ours_cfg).convert(ours_model)
    assert report.converted == ours.converted and report.skipped == ours.skipped
    assert ("layers.0.feed_forward.w2", "filtered by filter_fqns") in report.skipped
    kinds = {fqn: type(m) for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert all(kinds[fqn] is TorchaoFloat8Linear for fqn in report.converted)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # ours stays out
    assert all(kinds[fqn] is torch.nn.Linear for fqn, _ in report.skipped)
    version = _torchao_version()
    assert seam.describe("params float32") == f"float8 tensorwise (torchao {version}), params float32"
    assert seam.summary_lines() == [f"float8 (torchao {version}): {report}"]


@needs_torchao
@pytest.mark.parametrize(("scaling", "all_gather", "recipe"), [
    ("tensorwise", True, "tensorwise"), ("rowwise", False, "rowwise"), ("rowwise_gw_hp", False, "rowwise_with_gw_hp"),
])
def test_recipes_map_to_torchao_configs(scaling, all_gather, recipe):
    from torchao.float8 import Float8LinearConfig

    expected = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    config = torchao_config(scaling, all_gather, emulate=True)
    assert config.enable_fsdp_float8_all_gather == all_gather and config.emulate
    assert config.cast_config_input == expected.cast_config_input
    assert config.cast_config_grad_output_for_grad_weight == expected.cast_config_grad_output_for_grad_weight
    # float8.emulate reaches torchao's own emulation switch (fp32 GEMMs of the float8 values).
    seam = _seam(_cfg("--float8.scaling", scaling, "--float8.emulate", "true"))
    model = build_meta_model(LLAMA2_FLAVORS["debug"])
    seam.convert(model)
    assert model.layers["0"].attention.wq.config.emulate


@needs_torchao
@pytest.mark.parametrize(("scaling", "float8_tp", "device_type", "float8_styles"), [
    ("tensorwise", True, "cuda", True), ("tensorwise", True, "cpu", False),
    ("tensorwise", False, "cuda", False), ("rowwise", True, "cuda", False),
])
def test_tp_styles(scaling, float8_tp, device_type, float8_styles):
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        PrepareFloat8ModuleInput,
    )

    cfg = _cfg("--float8.scaling", scaling, "--parallelism.float8_tensor_parallel", str(float8_tp).lower())
    styles = _seam(cfg, device_type).tp_styles()
    if float8_styles:
        assert styles.colwise is Float8ColwiseParallel and styles.prepare_input is PrepareFloat8ModuleInput
        assert not styles.local_inputs  # torchao's colwise linears take the float8 DTensors as they are
    else:
        assert styles is PLAIN_TP_STYLES


@needs_torchao
@pytest.mark.parametrize(("args", "calls"), [
    (["--float8.fsdp_float8_all_gather", "true"], 1),
    ([], 0),
    (["--float8.scaling", "rowwise", "--float8.fsdp_float8_all_gather", "true"], 0),
])
def test_post_optimizer_step_precomputes_scales_with_the_float8_all_gather(monkeypatch, args, calls):
    import torchao.float8

    seen = []
    monkeypatch.setattr(torchao.float8, "precompute_float8_dynamic_scale_for_fsdp", seen.append)
    model = torch.nn.Linear(16, 16)
    _seam(_cfg(*args)).post_optimizer_step(model)
    assert seen == [model] * calls


@needs_torchao
def test_advice(monkeypatch):
    notes = _seam(_cfg("--float8.scaling", "rowwise", "--float8.fsdp_float8_all_gather", "true")).advice(
        torch.device("cpu"), dp_degree=2, tp_degree=1)
    assert any("torchao's eager float8" in n for n in notes)
    assert any("fsdp_float8_all_gather has no effect with float8.scaling = 'rowwise'" in n for n in notes)
    notes = _seam(_cfg("--compile.mode", "block")).advice(torch.device("cpu"), dp_degree=2, tp_degree=1)
    assert any("without float8.fsdp_float8_all_gather" in n for n in notes)
    assert not any("eager" in n for n in notes)
    monkeypatch.setattr(rules, "scaled_mm_supported", lambda rowwise, device_type: not rowwise)
    with pytest.raises(UserError, match=r"^float8\.scaling = 'rowwise' needs row-wise scaled float8 GEMMs"):
        _seam(_cfg("--float8.scaling", "rowwise")).advice(torch.device("cpu"), 1, 1)
    _seam(_cfg("--float8.scaling", "rowwise", "--float8.emulate", "true")).advice(torch.device("cpu"), 1, 1)


@needs_torchao
def test_dry_run_names_torchao(capsys):
    from trainer.dry_run import print_plan

    print_plan(_cfg("--model.n_layers", "2"))
    out = capsys.readouterr().out
    assert "precision         float8 tensorwise (torchao); params" in out
    assert "float8 linears    14 converted (wq, wk, wv, wo, w1, w2, w3 x2)" in out
