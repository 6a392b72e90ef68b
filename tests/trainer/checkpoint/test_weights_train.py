"""Weights in and out of train.py runs: trainer checkpoints (DCP) <-> Hugging Face, as a user
converts them (scripts/convert_weights.py in a subprocess), and configs that do not fit the model.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch

from models.llama import LLAMA2_FLAVORS, Transformer
from models.llama.weight_files import read_weights, write_hf
from tests.helpers import read_metrics, run_script, run_train
from trainer.checkpoint.dcp_reader import load_dcp_model

# The debug flavour cut to 2 layers, trained on tiny batches: seconds per run.
ARGS = dataclasses.replace(LLAMA2_FLAVORS["debug"], n_layers=2)
TRAIN = [
    "--model.n_layers", "2", "--training.batch_size", "2", "--training.seq_len", "32",
    "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
]  # fmt: skip


def train(dump: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_train([*TRAIN, "--job.dump_folder", str(dump), *extra], timeout=300)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def convert(*argv: str) -> None:
    proc = run_script("scripts/convert_weights.py", list(argv), timeout=120)
    assert proc.returncode == 0, proc.stderr


def first_loss(dump: Path, fmt: str, path: Path) -> float:
    out = ok(train(dump, "--training.steps", "1", "--checkpoint.initial_load_path", str(path),
                   "--checkpoint.initial_load_format", fmt))  # fmt: skip
    assert f"loaded initial weights ({fmt})" in out
    return read_metrics(dump)[0]["loss"]


@pytest.fixture(scope="module")
def step_3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = tmp_path_factory.mktemp("run")
    ok(train(dump, "--training.steps", "3", "--checkpoint.enable", "true", "--checkpoint.interval", "3"))
    return dump / "checkpoints" / "step-3"


@pytest.mark.slow
def test_trainer_checkpoint_exports_to_transformers(step_3: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    convert("--from", "dcp", "--to", "hf", "--flavor", "debug", str(step_3), str(tmp_path / "hf"))

    ours = Transformer(ARGS).eval()
    load_dcp_model(ours, step_3)
    _, exported = read_weights("hf", tmp_path / "hf", ARGS)
    for key, value in ours.state_dict().items():
        assert torch.equal(exported[key], value), key
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    tokens = torch.randint(0, ARGS.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(input_ids=tokens, use_cache=False).logits
        torch.testing.assert_close(theirs, ours(tokens), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_hf_to_dcp_starts_training_like_hf(step_3: Path, tmp_path: Path) -> None:
    convert("--from", "dcp", "--to", "hf", "--flavor", "debug", str(step_3), str(tmp_path / "hf"))
    convert("--from", "hf", "--to", "dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    losses = {
        "hf": first_loss(tmp_path / "run-hf", "hf", tmp_path / "hf"),
        "dcp": first_loss(tmp_path / "run-dcp", "dcp", tmp_path / "dcp"),
        "checkpoint": first_loss(tmp_path / "run-checkpoint", "dcp", step_3),
    }
    assert losses["hf"] == losses["dcp"] == losses["checkpoint"], losses


@pytest.mark.slow
def test_hf_config_that_does_not_fit_the_model_stops_the_run(tmp_path: Path) -> None:
    # Same shapes as the model, another RoPE base: loading it would train a different model.
    theirs = dataclasses.replace(ARGS, rope_theta=500000.0)
    torch.manual_seed(0)
    weights = {k: torch.randn(v.shape) for k, v in Transformer(theirs).state_dict().items()}
    write_hf(weights, theirs, tmp_path / "hf")
    proc = train(tmp_path / "run", "--training.steps", "1",
                 "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                 "--checkpoint.initial_load_format", "hf")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: checkpoint.initial_load_path: {tmp_path / 'hf'}: rope_theta is 500000.0 in the "
        "checkpoint, 10000.0 in the model"
    ], proc.stderr[-3000:]
