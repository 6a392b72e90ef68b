"""Weights & Biases as a metrics sink, offline: the keys and values of metrics.jsonl, resumed into the same run.

The run trains a mixture of the two shipped corpus files, so it also shows the mixture's startup
summary and its data/tokens/<source>, data/epoch/<source> metrics in a real run.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import train
from tests.helpers import ROOT, read_metrics
from trainer.metrics.logger import _tb_tag

SMALL = [
    "--model.n_layers", "1", "--training.seq_len", "32", "--training.batch_size", "2", "--training.steps", "4",
    "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
    "--validation.enable", "false", "--data.num_workers", "0",
]
MIXTURE = "".join(f'[[data.sources]]\npath = "{ROOT}/data/corpus/train-0000{i}.jsonl"\nweight = {w}\n'
                  for i, w in ((0, 0.75), (1, 0.25)))
# W&B's own keys in each history row.
WANDB_KEYS = {"_step", "_runtime", "_timestamp"}
BLOCK = 32768  # the .wandb file is a LevelDB-style log of 32 KiB blocks


def wandb_records(path: Path) -> Iterator:
    """The protobuf Records of an offline run's .wandb file (W&B 0.31 ships no reader of its own)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, chunks = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def offline_run(dump: Path, nth: int) -> tuple[str, dict, dict[int, dict]]:
    """(run id, config, {step: values}) of the nth offline run W&B wrote under dump/wandb."""
    (path,) = sorted(dump.glob("wandb/offline-run-*"))[nth].glob("run-*.wandb")
    for _ in range(100):  # W&B's service process may still be writing the file when finish() returns
        records = list(wandb_records(path))
        if records and records[-1].WhichOneof("record_type") == "exit":
            break
        time.sleep(0.1)
    run_id, config, history = "", {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[row["_step"]] = {k: v for k, v in row.items() if k not in WANDB_KEYS}
    return run_id, config, history


def as_tensorboard(row: dict) -> dict:
    return {_tb_tag(k): v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


@pytest.mark.slow
def test_offline_wandb_logs_the_metrics_and_resumes_the_same_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "mix.toml").write_text(MIXTURE)
    dump = tmp_path / "run"
    args = ["--config", str(tmp_path / "mix.toml"), *SMALL, "--job.dump_folder", str(dump), "--metrics.enable_wandb",
            "true", "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    assert train.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "data.sources: 2 sources" in out and "train-00000: weight 0.75 (75.0 %)" in out
    rows = read_metrics(dump)
    assert rows[-1]["data/tokens/train-00000"] == 3 * rows[-1]["data/tokens/train-00001"] == 6 * 32
    run_id, config, history = offline_run(dump, 0)
    assert run_id == (dump / "wandb_id").read_text().strip()
    assert config["data"]["sources"][1]["weight"] == 0.25 and config["training"]["steps"] == 4
    assert history == {r["step"]: as_tensorboard(r) for r in rows}

    # stopped after the checkpoint of step 2: the resumed run continues the same W&B run
    shutil.rmtree(dump / "checkpoints" / "step-4")
    time.sleep(1.0)  # W&B names an offline run's folder by the second: a resume within it would reuse the folder
    assert train.main(args) == 0, capsys.readouterr().err
    resumed_id, _, resumed = offline_run(dump, 1)
    assert resumed_id == run_id
    assert resumed == {r["step"]: as_tensorboard(r) for r in read_metrics(dump) if r["step"] > 2}
    assert sorted(resumed) == [3, 4]


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    assert train.main([*SMALL, "--job.dump_folder", str(tmp_path), "--metrics.enable_wandb", "true"]) == 2
    assert capsys.readouterr().err == ("error: metrics.enable_wandb = true needs the wandb package: "
                                       "pip install -e '.[wandb]' (or set metrics.enable_wandb = false)\n")
    assert not (tmp_path / "metrics.jsonl").exists()
