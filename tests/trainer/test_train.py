"""End-to-end runs of train.py as a user would start it."""

import json
import math

import pytest

from tests.helpers import read_metrics, run_train, train_in_process
from trainer.metrics.logger import METRIC_KEYS
from trainer.precision import resolve_param_precision


@pytest.mark.slow
def test_short_run_writes_outputs_and_loss_falls(tmp_path):
    dump = tmp_path / "run"
    result = run_train([
        "--job.dump_folder", str(dump), "--training.steps", "30", "--metrics.log_freq", "5",
        "--training.seq_len", "128", "--model.n_layers", "2",
    ])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    for row in rows:
        assert set(METRIC_KEYS) <= set(row), set(METRIC_KEYS) - set(row)
        assert row["mfu_pct"] is None  # CPU: no known peak
        assert row["tps"] > 0 and row["tflops"] > 0 and math.isfinite(row["loss"])
        # On a CPU nothing overlaps: the step's period holds its forward+backward, reading the next
        # step's batches (a GPU reads them while it runs the step), the optimizer and the logging.
        assert row["fwd_bwd_time_s"] > 0 and row["data_time_s"] > 0
        assert row["data_time_s"] + row["fwd_bwd_time_s"] < row["step_time_s"]
    assert rows[-1]["tokens_seen"] == 30 * 4 * 128
    assert rows[-1]["data/epoch"] == 0  # 120 windows of 129 tokens: far less than the shipped corpus
    assert rows[-1]["loss"] < rows[0]["loss"] - 2.0, [r["loss"] for r in rows]
    assert (dump / "config.toml").read_text().count("[training]") == 1
    # The run is named after the precision `auto` picked for this CPU.
    precision = {"bfloat16": "bf16", "float32": "fp32"}[resolve_param_precision("auto", "cpu").dtype]
    events = list((dump / "tb" / f"debug-{precision}-none").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    assert "model llama2 debug" in result.stdout and "tokens per step 512" in result.stdout


@pytest.mark.slow
def test_tensorboard_tags_match_metric_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = tmp_path / "run"
    result = run_train(["--job.dump_folder", str(dump), "--training.steps", "2", "--metrics.log_freq", "1",
                        "--training.seq_len", "64", "--model.n_layers", "1", "--job.run_name", "tags"])
    assert result.returncode == 0, result.stderr[-3000:]
    acc = EventAccumulator(str(dump / "tb" / "tags"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("throughput/tps", "throughput/tflops", "loss/loss", "loss/grad_norm", "loss/lr",
                "memory/peak_active_gib", "time/step_time_s", "time/data_time_s", "time/fwd_bwd_time_s"):
        assert key in tags, (key, tags)
    assert acc.Scalars("loss/loss")[0].step == 1


@pytest.mark.slow
def test_bad_data_path_exits_2(tmp_path):
    result = run_train(["--job.dump_folder", str(tmp_path), "--data.path", str(tmp_path / "nope.jsonl")])
    assert result.returncode == 2
    assert "nope.jsonl" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_bad_jsonl_line_names_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    result = run_train(["--job.dump_folder", str(tmp_path / "o"), "--data.path", str(data)])
    assert result.returncode == 2
    assert "d.jsonl:2: not valid JSON" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_missing_tokenizer_exits_2(tmp_path):
    result = run_train(["--job.dump_folder", str(tmp_path), "--model.tokenizer_path", str(tmp_path / "t.model")])
    assert result.returncode == 2
    assert "t.model" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_empty_dataset_exits_2(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    result = run_train(["--job.dump_folder", str(tmp_path / "o"), "--data.path", str(data)])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "empty.jsonl" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_missing_text_field_names_file_and_line(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    result = run_train(["--job.dump_folder", str(tmp_path / "o"), "--data.path", str(data)])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().endswith("d.jsonl:2: missing field 'text' (fields: body)"), result.stderr
    assert "Traceback" not in result.stderr


def test_the_config_is_read_never_written(tmp_path):
    """A run leaves its Config as loaded; config.toml records what was in force (the resolved dtype)."""
    import copy

    from trainer.config import build_config, load_toml

    dump = tmp_path / "run"
    cfg = build_config(["--job.dump_folder", str(dump), "--training.steps", "2", "--training.seq_len", "32",
                        "--model.n_layers", "1", "--metrics.enable_tensorboard", "false"])
    loaded = copy.deepcopy(cfg)
    train_in_process(cfg)
    assert cfg == loaded and cfg.training.mixed_precision_param == "auto"
    in_force = load_toml(str(dump / "config.toml"))
    assert in_force["training"]["mixed_precision_param"] == resolve_param_precision("auto", "cpu").dtype
