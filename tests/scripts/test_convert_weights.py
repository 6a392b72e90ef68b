"""scripts/convert_weights.py end to end, and its one-line errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from models.llama import LLAMA2_FLAVORS, Transformer, initialized_model
from models.llama.weight_conversion import hf_config_from_args, llama_to_hf
from models.llama.weight_files import load_tensor_file, read_weights, write_weights
from scripts.convert_weights import main
from tests.helpers import run_script

DEBUG = LLAMA2_FLAVORS["debug"]


@pytest.fixture(scope="module")
def debug_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with torch.device("meta"):
        shapes = Transformer(DEBUG).state_dict()
    return {key: torch.randn(t.shape) for key, t in shapes.items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_meta_to_hf_to_torch_to_meta(
    tmp_path: Path, debug_state_dict: dict[str, torch.Tensor]
) -> None:
    write_weights("meta", debug_state_dict, DEBUG, tmp_path / "meta", num_shards=2)
    steps = [
        ["--from", "meta", "--to", "hf", str(tmp_path / "meta"), str(tmp_path / "hf")],
        [
            "--from",
            "hf",
            "--to",
            "torch",
            str(tmp_path / "hf"),
            str(tmp_path / "model.safetensors"),
        ],
        [
            "--from",
            "torch",
            "--to",
            "meta",
            "--flavor",
            "debug",
            str(tmp_path / "model.safetensors"),
            str(tmp_path / "meta2"),
        ],
    ]
    for argv in steps:
        assert main(argv) == 0, argv
    args, state_dict = read_weights("meta", tmp_path / "meta2", DEBUG)
    # params.json has no max_seq_len (Meta's loader passes it separately).
    assert dataclasses.replace(args, max_seq_len=DEBUG.max_seq_len) == DEBUG
    assert_same(state_dict, debug_state_dict)


def test_dtype_cast(tmp_path: Path, debug_state_dict: dict[str, torch.Tensor]) -> None:
    write_weights("torch", debug_state_dict, DEBUG, tmp_path / "model.pt")
    argv = ["--from", "torch", "--to", "hf", "--flavor", "debug", "--dtype", "bf16"]
    assert main([*argv, str(tmp_path / "model.pt"), str(tmp_path / "hf")]) == 0
    _, state_dict = read_weights("hf", tmp_path / "hf", DEBUG)
    assert {t.dtype for t in state_dict.values()} == {torch.bfloat16}


def test_dcp_round_trip_keeps_weights_and_dtype(
    tmp_path: Path, debug_state_dict: dict[str, torch.Tensor]
) -> None:
    # Two layers of the debug flavour, as model.n_layers = 2 trains it: the depth comes from the weights.
    shallow = dataclasses.replace(DEBUG, n_layers=2)
    two_layers = {k: v for k, v in debug_state_dict.items() if not k.startswith(("layers.2.", "layers.3."))}
    write_weights("torch", two_layers, shallow, tmp_path / "model.safetensors")
    steps = [
        ["--from", "torch", "--to", "dcp", "--flavor", "debug", "--dtype", "bf16",
         str(tmp_path / "model.safetensors"), str(tmp_path / "dcp")],
        ["--from", "dcp", "--to", "torch", "--flavor", "debug", str(tmp_path / "dcp"), str(tmp_path / "back.pt")],
    ]  # fmt: skip
    for argv in steps:
        assert main(argv) == 0, argv
    _, state_dict = read_weights("torch", tmp_path / "back.pt", shallow)
    assert_same(state_dict, {k: v.bfloat16() for k, v in two_layers.items()})


def test_reads_pytorch_model_bin(tmp_path: Path, debug_state_dict: dict[str, torch.Tensor]) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    torch.save(llama_to_hf(debug_state_dict, DEBUG), hf_dir / "pytorch_model.bin")
    (hf_dir / "config.json").write_text(json.dumps(hf_config_from_args(DEBUG)))
    _, state_dict = read_weights("hf", hf_dir, DEBUG)
    assert_same(state_dict, debug_state_dict)


def test_random_source_is_the_trainers_initial_weights(tmp_path: Path) -> None:
    # A one-process CPU train.py run starts from initialized_model's weights (trainer/model_setup.py).
    assert main(["--from", "random", "--to", "torch", "--flavor", "debug", "--n-layers", "1", "--seed", "7",
                 str(tmp_path / "random.safetensors")]) == 0
    trainers = initialized_model(dataclasses.replace(DEBUG, n_layers=1), seed=7).state_dict()
    assert_same(load_tensor_file(tmp_path / "random.safetensors"), trainers)
    assert {t.dtype for t in trainers.values()} == {torch.float32}


def test_bad_inputs_exit_2_with_one_line(
    tmp_path: Path, debug_state_dict: dict[str, torch.Tensor], capsys: pytest.CaptureFixture[str]
) -> None:
    write_weights("torch", debug_state_dict, DEBUG, tmp_path / "model.pt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    cases = {
        "directory not found": ["--from", "hf", "--to", "torch", str(tmp_path / "nope"), str(tmp_path / "a.pt")],
        "needs --flavor": ["--from", "torch", "--to", "hf", str(tmp_path / "model.pt"), str(tmp_path / "b")],
        "already exists": ["--from", "torch", "--to", "hf", "--flavor", "debug", str(tmp_path / "model.pt"), str(tmp_path / "taken")],
        "'tok_embeddings.weight' has shape (2048, 256), the model expects (2048, 4096)": [
            "--from", "torch", "--to", "hf", "--flavor", "7B", str(tmp_path / "model.pt"), str(tmp_path / "c"),
        ],
        "--from dcp needs --flavor": ["--from", "dcp", "--to", "hf", str(tmp_path / "dcp"), str(tmp_path / "d")],
        "is not a complete DCP checkpoint (no .metadata)": [
            "--from", "dcp", "--to", "hf", "--flavor", "debug", str(tmp_path / "taken"), str(tmp_path / "e"),
        ],
    }  # fmt: skip
    assert main(["--from", "torch", "--to", "dcp", "--flavor", "debug", str(tmp_path / "model.pt"), str(tmp_path / "dcp")]) == 0
    for message, argv in cases.items():
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, err
        assert err.count("\n") == 1, err


@pytest.mark.slow
def test_cli_prints_no_traceback(tmp_path: Path) -> None:
    argv = ["--from", "meta", "--to", "hf", str(tmp_path / "missing"), str(tmp_path / "out")]
    result = run_script("scripts/convert_weights.py", argv)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
