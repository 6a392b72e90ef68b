"""The float8 advice of our implementation (trainer/float8_seam/rules.py and ours.py): every warning, the refusal on GPUs without float8 GEMMs, and the user seeing it."""

from __future__ import annotations

import re

import pytest
import torch

from float8 import Float8ConversionReport
from float8.autofilter import AUTO_RULE
from float8.convert import ALIGNMENT, FILTER_FQNS
from tests.helpers import ROOT, run_train
from trainer.config import Config
from trainer.errors import UserError
from trainer.float8_seam import rules
from trainer.float8_seam.ours import CPU_COMPILED_ROWWISE_NOTE, MIN_FLOAT8_TOKENS
from trainer.float8_seam.rules import Float8RunContext
from trainer.float8_seam.seam import build_seam

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)


def advise(
    cfg: Config, device: torch.device, float8_report: Float8ConversionReport | None = None, dp_degree: int = 1, tp_degree: int = 1
) -> list[str]:
    seam = build_seam(cfg.float8, Float8RunContext.for_run(cfg, device.type, "bfloat16"))
    seam.report = float8_report
    return seam.advice(device, dp_degree, tp_degree)


def _cfg(**float8: object) -> Config:
    """float8 on, compiled, FSDP all-gather on: a config with nothing to warn about."""
    cfg = Config()
    cfg.float8.enabled = True
    cfg.float8.fsdp_float8_all_gather = True
    cfg.compile.mode = "block"
    for key, value in float8.items():
        setattr(cfg.float8, key, value)
    return cfg


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA device with the given capability exists; advise only asks capability and name."""

    def install(capability: tuple[int, int], name: str) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)

    return install


def _only(notes: list[str], needle: str) -> str:
    hits = [n for n in notes if needle in n]
    assert len(hits) == 1, notes
    return hits[0]


def test_quiet_when_nothing_to_say():
    assert advise(_cfg(), CPU) == []
    bf16 = Config()  # float8 off: no float8 advice, whatever the other settings
    bf16.compile.mode = "none"
    assert advise(bf16, CPU) == []


def test_float8_without_compile():
    cfg = _cfg()
    cfg.compile.mode = "none"
    note = _only(advise(cfg, CPU), "compile.mode = 'none'")
    assert "set compile.mode = 'block'" in note
    # One machine's measured speed-up is no promise for this one: the note names where it was measured.
    assert not re.search(r"\d\.\d+x", note)
    table = re.search(r"docs/benchmarks.md, table '([^']+)'", note).group(1)
    assert f"## {table}" in (ROOT / "docs" / "benchmarks.md").read_text()
    for mode in ("block", "model"):
        cfg.compile.mode = mode
        assert not [n for n in advise(cfg, CPU) if "compile.mode" in n]


def test_float8_without_compile_with_the_triton_casts(monkeypatch):
    """Where the eager casts are float8/kernels (CUDA with Triton), eager float8 is no longer
    called slow: the note says it beats eager bf16 and where that was measured."""
    import trainer.float8_seam.ours as seam

    monkeypatch.setattr(seam, "eager_backend", lambda device_type, mode: "triton")
    cfg = _cfg()
    cfg.compile.mode = "none"
    note = _only(advise(cfg, CPU), "compile.mode = 'none'")
    assert "beats eager bf16" in note and "gains little" not in note and "set compile.mode = 'block'" in note
    table = re.search(r"docs/benchmarks.md, table '([^']+)'", note).group(1)
    assert f"## {table}" in (ROOT / "docs" / "benchmarks.md").read_text()


def test_emulate():
    note = _only(advise(_cfg(emulate=True), CPU), "float8.emulate = true")
    assert "testing only" in note


def test_gpu_without_float8_gemms_is_refused(fake_gpu):
    fake_gpu((8, 0), "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError) as e:
        advise(_cfg(), CUDA)
    message = str(e.value)
    assert "NVIDIA A100-SXM4-80GB is sm_80" in message and "float8.emulate = true" in message
    assert "\n" not in message
    # emulate is the documented escape hatch: it warns instead of refusing
    assert _only(advise(_cfg(emulate=True), CUDA), "float8.emulate = true")


def test_float8_gpu_is_accepted(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    cfg = _cfg()
    cfg.training.batch_size, cfg.training.seq_len = 2, 4096
    assert advise(cfg, CUDA) == []


def test_tiny_gemms_on_gpu(fake_gpu):
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    cfg = _cfg()
    cfg.training.batch_size, cfg.training.seq_len = 1, 4096
    note = _only(advise(cfg, CUDA), "tokens per GPU per micro-batch")
    assert "= 4096 tokens" in note and str(MIN_FLOAT8_TOKENS) in note
    cfg.training.batch_size = 2  # exactly the threshold: fine
    assert advise(cfg, CUDA) == []
    # tensor parallel splits the sequence, so the per-GPU GEMM shrinks again
    assert _only(advise(cfg, CUDA, tp_degree=2), "= 4096 tokens")
    cfg.training.batch_size = 1
    assert not [n for n in advise(cfg, CPU) if "tokens per GPU" in n]  # CPU runs are tiny on purpose


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp"])
def test_fsdp_float8_all_gather_with_rowwise(monkeypatch, scaling):
    # Whether this torch runs row-wise GEMMs on CPU (2.11 does not) is another test's concern.
    monkeypatch.setattr(rules, "scaled_mm_supported", lambda rowwise, device_type: True)
    note = _only(advise(_cfg(scaling=scaling), CPU), "fsdp_float8_all_gather has no effect")
    assert f"float8.scaling = '{scaling}'" in note
    assert advise(_cfg(scaling=scaling, fsdp_float8_all_gather=False), CPU) == (
        [CPU_COMPILED_ROWWISE_NOTE] if scaling == "rowwise" else [])


def test_rowwise_compiled_on_a_cpu_with_bf16_params_is_warned(monkeypatch):
    monkeypatch.setattr(rules, "scaled_mm_supported", lambda rowwise, device_type: True)
    cfg = _cfg(scaling="rowwise", fsdp_float8_all_gather=False)
    assert advise(cfg, CPU) == [CPU_COMPILED_ROWWISE_NOTE]
    fp32 = build_seam(cfg.float8, Float8RunContext.for_run(cfg, "cpu", "float32"))
    assert fp32.advice(CPU, 1, 1) == []
    cfg.compile.mode = "none"
    assert CPU_COMPILED_ROWWISE_NOTE not in advise(cfg, CPU)


def test_tensorwise_without_fsdp_float8_all_gather():
    cfg = _cfg(fsdp_float8_all_gather=False)
    note = _only(advise(cfg, CPU, dp_degree=2), "without float8.fsdp_float8_all_gather")
    assert "set float8.fsdp_float8_all_gather = true" in note
    assert advise(cfg, CPU, dp_degree=1) == []  # no FSDP sharding, nothing to all-gather


def _report(*skipped: tuple[str, str, str]) -> Float8ConversionReport:
    """A conversion report of linears kept in high precision: (fqn, rule, why) each."""
    report = Float8ConversionReport()
    for fqn, rule, why in skipped:
        report.skip(fqn, rule, why)
    return report


OUTPUT_FILTERED = ("output", FILTER_FQNS, "filtered by filter_fqns")


def test_layers_skipped_by_size_but_not_by_filter():
    report = _report(OUTPUT_FILTERED, *[
        (f"layers.{i}.attention.wk", ALIGNMENT, "out_features 64 not divisible by 16") for i in range(6)
    ])
    note = _only(advise(_cfg(), CPU, report), "stay in high precision")
    assert note.startswith("6 linear layers stay in high precision")
    assert "layers.0.attention.wk (out_features 64 not divisible by 16)" in note
    assert "layers.3.attention.wk" in note and "layers.4.attention.wk" not in note
    assert note.endswith("and 2 more")
    assert "output" not in note  # the user asked for that one
    assert advise(_cfg(), CPU, _report(OUTPUT_FILTERED)) == []
    # What filter = "auto" keeps, the summary lists with its timings: no warning for it.
    assert advise(_cfg(), CPU, _report(OUTPUT_FILTERED, ("layers.0.attention.wk", AUTO_RULE, "auto: 64->64 ..."))) == []


def test_layers_filtered_beyond_the_default():
    cfg = _cfg()
    cfg.float8.filter_fqns = ["output", "wq"]
    report = _report(OUTPUT_FILTERED, *[
        (f"layers.{i}.attention.wq", FILTER_FQNS, "filtered by filter_fqns") for i in range(5)
    ])
    note = _only(advise(cfg, CPU, report), "float8.filter_fqns keeps")
    assert note.startswith("float8.filter_fqns keeps 5 more linear layers in high precision than the default ['output']")
    assert "layers.0.attention.wq, layers.1.attention.wq" in note and note.endswith("no float8 speed-up")
    assert "and 1 more" in note and "output," not in note


@pytest.mark.slow
def test_warning_reaches_the_user(tmp_path):
    result = run_train([
        "--float8.enabled", "true", "--training.steps", "2", "--training.batch_size", "2",
        "--training.seq_len", "64", "--job.dump_folder", str(tmp_path),
    ])
    assert result.returncode == 0, result.stderr
    assert "warning: float8.enabled with compile.mode = 'none'" in result.stderr
    assert "warning:" not in result.stdout  # warnings go to stderr only
    # One process means no FSDP sharding: the all-gather advice would be noise here.
    assert "fsdp_float8_all_gather" not in result.stderr


@pytest.mark.slow
def test_dry_run_prints_the_warnings():
    result = run_train(["--float8.enabled", "true", "--float8.filter_fqns", "output,wq", "--job.dry_run", "true"])
    assert result.returncode == 0, result.stderr
    assert "  warning: float8.enabled with compile.mode = 'none'" in result.stdout
    assert "  warning: float8.filter_fqns keeps 4 more linear layers" in result.stdout
