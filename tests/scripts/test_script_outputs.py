"""Scripts never replace earlier outputs silently: benchmarks move them to previous-N/, generators
refuse (exit 2, one line) unless --force. No test here runs training."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scripts import bench_ac, bench_float8, make_corpus, make_sft_data, train_tokenizer
from scripts import compare_throughput as ct
from scripts import gpu_check as gc
from scripts.harness.compare.run import CellResult
from trainer.run_folder import keep_earlier_results


def _fill(folder: Path, *names: str) -> None:
    for name in names:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"earlier {name}")


def test_keep_earlier_results_moves_only_the_named_entries_to_the_next_previous_folder(tmp_path, capsys):
    _fill(tmp_path, "results.json", "runs/a/metrics.jsonl", "notes.txt")
    assert keep_earlier_results(tmp_path, ["results.json", "runs", "missing.md"]) == tmp_path / "previous-1"
    assert (tmp_path / "previous-1" / "runs" / "a" / "metrics.jsonl").read_text() == "earlier runs/a/metrics.jsonl"
    assert (tmp_path / "previous-1" / "results.json").is_file() and (tmp_path / "notes.txt").is_file()
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "runs").exists()
    assert capsys.readouterr().out == f"kept the earlier results.json, runs in {tmp_path / 'previous-1'}/\n"
    _fill(tmp_path, "results.json")
    assert keep_earlier_results(tmp_path, ["results.json"]) == tmp_path / "previous-2"
    assert keep_earlier_results(tmp_path, ["results.json"]) is None  # nothing left to keep
    assert keep_earlier_results(tmp_path / "new", ["results.json"]) is None
    assert capsys.readouterr().out.count("\n") == 1


def _failed(precision: str, mode: str, *rest) -> CellResult:
    return CellResult(precision, mode, reason="RuntimeError: no luck", wall_s=0.0)


def test_compare_throughput_keeps_an_earlier_comparison(tmp_path, monkeypatch, capsys):
    earlier = ("comparison.json", "comparison.md", "runs/bf16-none/metrics.jsonl", "tb/bf16-none/events")
    _fill(tmp_path, *earlier, "mine.txt")
    monkeypatch.setattr(ct, "run_cell", _failed)
    argv = ["--config", "configs/debug.toml", "--out", str(tmp_path), "--steps", "2", "--precisions", "bf16",
            "--compile", "none"]
    assert ct.main(argv) == 1
    for name in earlier:
        assert (tmp_path / "previous-1" / name).read_text() == f"earlier {name}"
    assert json.loads((tmp_path / "comparison.json").read_text())["failures"] == {"bf16-none": "RuntimeError: no luck"}
    assert (tmp_path / "mine.txt").is_file()  # not the script's: left where it is
    assert capsys.readouterr().out.splitlines()[0].startswith("kept the earlier comparison.md, comparison.json, tb")


def test_compare_throughput_bad_arguments_move_nothing(tmp_path, capsys):
    _fill(tmp_path, "comparison.json")
    assert ct.main(["--config", "configs/debug.toml", "--out", str(tmp_path), "--precisions", "fp4"]) == 2
    assert (tmp_path / "comparison.json").is_file() and not (tmp_path / "previous-1").exists()
    assert capsys.readouterr().err.count("\n") == 1


def test_gpu_check_keeps_an_earlier_check(tmp_path, monkeypatch):
    _fill(tmp_path, "gpu_check.json", "gpu_check.md", "runs/fsdp-bf16-none/log.txt", "w/hf/config.json")
    monkeypatch.setattr(gc, "run_all", lambda cli, table: {})
    monkeypatch.chdir(tmp_path)  # main moves to the repository root; monkeypatch moves back
    gc.main(["--device", "cpu", "--flavor", "debug", "--only", "ac", "--out", str(tmp_path)])
    assert sorted(p.name for p in (tmp_path / "previous-1").iterdir()) == ["gpu_check.json", "gpu_check.md", "runs", "w"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["groups"] == ["ac"]


def test_bench_ac_keeps_earlier_cells_and_checks_its_lists(tmp_path, monkeypatch, capsys):
    _fill(tmp_path, "results.json", "bf16-block-full/log.txt")
    monkeypatch.setattr(bench_ac, "run_cell", lambda a, p, c, ac: {"precision": p, "compile": c, "ac": ac,
                                                                   "ok": False, "reason": "RuntimeError: no"})
    assert bench_ac.main(["--precisions", "bf16", "--compile", "none", "--ac", "none", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in (tmp_path / "previous-1").iterdir()) == ["bf16-block-full", "results.json"]
    assert json.loads((tmp_path / "results.json").read_text())["cells"][0]["reason"] == "RuntimeError: no"
    capsys.readouterr()
    assert bench_ac.main(["--ac", "none,partial", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --ac: unknown name 'partial' (choose from none, full, selective)\n"


def test_bench_float8_keeps_an_earlier_results_file(tmp_path, monkeypatch):
    out = tmp_path / "bench.json"
    out.write_text("earlier")
    monkeypatch.setattr(sys, "argv", ["bench_float8.py", "--smoke", "--only", "linears", "--modes", "bf16",
                                      "--variants", "eager", "--out", str(out)])
    bench_float8.main()
    assert (tmp_path / "previous-1" / "bench.json").read_text() == "earlier"
    assert json.loads(out.read_text())["results"]


def _refused(capsys, path: Path) -> None:
    err = capsys.readouterr().err
    assert err == f"error: {path} exists; pass --force to overwrite it, or choose another --out\n"


def test_make_corpus_refuses_earlier_shards_and_force_replaces_all_of_them(tmp_path, capsys):
    assert make_corpus.main(["--out", str(tmp_path), "--docs", "4", "--shards", "2"]) == 0
    assert make_corpus.main(["--out", str(tmp_path), "--docs", "4", "--shards", "1"]) == 2
    _refused(capsys, tmp_path / "train-00000.jsonl")
    assert make_corpus.main(["--out", str(tmp_path), "--docs", "4", "--shards", "1", "--force"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["train-00000.jsonl"]  # no stale second shard
    assert make_corpus.main(["--out", str(tmp_path), "--docs", "4", "--name", "valid"]) == 0  # other names: fine


def test_make_sft_data_refuses_unless_forced(tmp_path, capsys):
    small = ["--out", str(tmp_path), "--train", "4", "--eval", "2", "--chat", "1"]
    _fill(tmp_path, "eval.jsonl")
    assert make_sft_data.main(small) == 2
    _refused(capsys, tmp_path / "eval.jsonl")
    assert make_sft_data.main([*small, "--force"]) == 0
    assert len((tmp_path / "eval.jsonl").read_text().splitlines()) == 2


def test_train_tokenizer_refuses_before_training(tmp_path, capsys):
    out = tmp_path / "tok.model"
    out.write_bytes(b"earlier")
    assert train_tokenizer.main([str(tmp_path / "no-such-input"), "--out", str(out)]) == 2
    _refused(capsys, out)
    assert out.read_bytes() == b"earlier"

