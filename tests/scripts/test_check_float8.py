"""scripts/check_float8.py --model-gemms on the debug model (CPU, emulated block GEMMs): the operands
come from the --checkpoint's weights when one is given (a DCP folder or an exported model file), and a
checkpoint of another model is one line."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from models.llama import LLAMA2_FLAVORS
from models.llama.model import initialized_model
from scripts import check_float8
from trainer.checkpoint.export import export_model
from trainer.cli import run_command
from trainer.data.tokenizer import Tokenizer

ARGS = ["--model-gemms", "--device", "cpu", "--flavor", "debug", "--layers", "1", "--batch", "1", "--seq", "64",
        "--recipes", "tensorwise,blockwise"]


ARGS_1_LAYER = dataclasses.replace(LLAMA2_FLAVORS["debug"], n_layers=1, max_seq_len=65,
                                  vocab_size=Tokenizer("data/tokenizer.model").n_words)


def _checkpoint(path, seed: int) -> str:
    dcp.save(initialized_model(ARGS_1_LAYER, seed=seed).state_dict(), checkpoint_id=str(path), no_dist=True)
    return str(path)


def _table(tmp_path, *extra: str) -> dict:
    out = tmp_path / "sqnr.json"
    check_float8.main([*ARGS, "--out", str(out), *extra])  # 0 or 1 (blockwise's bar): the table is what counts
    return json.loads(out.read_text())["sqnr_db"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_model_gemms_take_the_checkpoints_weights(tmp_path, capsys):
    fresh = _table(tmp_path)
    # The fresh init is seed 42's: a checkpoint of it gives the same operands, another model's do not.
    assert _table(tmp_path, "--checkpoint", _checkpoint(tmp_path / "same", 42)) == fresh
    export_model(initialized_model(ARGS_1_LAYER, seed=42).state_dict(), ARGS_1_LAYER, tmp_path / "final", torch.bfloat16)
    assert _table(tmp_path, "--checkpoint", str(tmp_path / "final" / "model.safetensors")) == fresh
    other = _table(tmp_path, "--checkpoint", _checkpoint(tmp_path / "other", 7))
    assert other.keys() == fresh.keys() and other != fresh
    code = run_command(lambda: check_float8.main([*ARGS, "--layers", "2", "--checkpoint", str(tmp_path / "same")]))
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: --checkpoint {tmp_path / 'same'} lacks")
    # A trainer's model may have more rows of embedding than its tokenizer has words (model.vocab_size).
    wide = dataclasses.replace(ARGS_1_LAYER, vocab_size=ARGS_1_LAYER.vocab_size + 64)
    export_model(initialized_model(wide, seed=7).state_dict(), wide, tmp_path / "wide", torch.bfloat16)
    wide_file = str(tmp_path / "wide" / "model.safetensors")
    assert run_command(lambda: check_float8.main([*ARGS, "--checkpoint", wide_file])) == 2
    assert "the model expects" in capsys.readouterr().err.strip().splitlines()[-1]
    assert _table(tmp_path, "--checkpoint", wide_file, "--vocab-size", str(wide.vocab_size)).keys() == fresh.keys()
