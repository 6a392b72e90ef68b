"""training.mixed_precision_param = auto: bf16 where the device computes it natively, else float32."""

import re

import pytest

from tests.helpers import ROOT, run_train
from trainer import precision
from trainer.precision import resolve_param_precision


@pytest.fixture
def cpu(monkeypatch):
    def set_cpu(native: bool, capability: str) -> None:
        monkeypatch.setattr(precision, "cpu_bf16_support", lambda: (native, capability))

    return set_cpu


def test_auto_is_bf16_on_cuda():
    picked = resolve_param_precision("auto", "cuda")
    assert picked.dtype == "bfloat16" and picked.warning is None


def test_auto_on_cpu_follows_native_bf16(cpu):
    cpu(True, "AVX512")
    assert resolve_param_precision("auto", "cpu").dtype == "bfloat16"
    cpu(False, "AVX2")
    picked = resolve_param_precision("auto", "cpu")
    assert picked.dtype == "float32" and "AVX2" in picked.reason and picked.warning is None


def test_explicit_bf16_on_slow_cpu_warns_and_is_kept(cpu):
    cpu(False, "AVX2")
    picked = resolve_param_precision("bfloat16", "cpu")
    assert picked.dtype == "bfloat16"
    assert "without native bf16 (AVX2)" in picked.warning and "slower than float32" in picked.warning
    # How much slower depends on the CPU: the warning names where it was measured, quoting no factor.
    assert not re.search(r"\d+x", picked.warning)
    section = re.search(r"docs/benchmarks.md, section '([^']+)'", picked.warning).group(1)
    assert f"## {section}" in (ROOT / "docs" / "benchmarks.md").read_text()
    cpu(True, "AVX512")
    assert resolve_param_precision("bfloat16", "cpu").warning is None
    assert resolve_param_precision("float32", "cpu").warning is None


@pytest.mark.slow
def test_avx2_cpu_trains_in_float32_and_says_why(tmp_path):
    # ATEN_CPU_CAPABILITY makes torch run (and report) its AVX2 kernels on any x86 CPU.
    env = {"ATEN_CPU_CAPABILITY": "avx2"}
    args = ["--training.steps", "1", "--model.n_layers", "1", "--training.seq_len", "32",
            "--metrics.enable_tensorboard", "false"]
    auto = run_train([*args, "--job.dump_folder", str(tmp_path / "auto")], env=env)
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "params float32 (auto: this CPU (AVX2) has no native bf16" in auto.stdout
    assert 'mixed_precision_param = "float32"' in (tmp_path / "auto" / "config.toml").read_text()
    assert "warning: training.mixed_precision_param" not in auto.stderr
    explicit = run_train([*args, "--job.dump_folder", str(tmp_path / "bf16"),
                          "--training.mixed_precision_param", "bfloat16"], env=env)
    assert explicit.returncode == 0, explicit.stderr[-2000:]
    assert explicit.stderr.count("warning: training.mixed_precision_param = 'bfloat16' on a CPU without") == 1
