"""scripts/compare_throughput.py and its parts (scripts/harness/compare/: run, report, chart):
pure table/speedup helpers, argument errors, profiles per cell, charts merged from result
files, and CPU runs."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import compare_throughput as ct
from scripts.harness import cells, traces
from scripts.harness.compare import chart
from scripts.harness.compare import report as rep
from scripts.harness.compare import run as cr
from tests.helpers import run_script
from tests.scripts.test_profile_summary import EXPECTED, synthetic_trace
from trainer.config import build_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Small enough that a compiled cell costs seconds, not minutes, on 2 cores.
TINY = ["--training.batch_size", "2", "--training.seq_len", "64"]


def _record(step: int, tps: float, loss: float = 5.0, mem: float = 1.0, mfu: float | None = None) -> dict:
    return {
        "step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tps": tps, "tflops": tps / 1000,
        "mfu_pct": mfu, "step_time_s": 100 / tps, "data_time_s": 0.0,
        "memory/peak_active_gib": mem, "memory/peak_reserved_gib": mem, "tokens_seen": step * 100,
    }


def _ok(precision: str, mode: str, tps: float) -> cr.CellResult:
    return cr.CellResult(precision, mode, ok=True, tps=tps, tflops=tps / 1000, peak_memory_gib=1.0,
                         first_step_s=2.0, final_loss=4.0, steps_measured=3)


def _failed(precision: str, mode: str, reason: str = "RuntimeError: boom") -> cr.CellResult:
    return cr.CellResult(precision, mode, reason=reason, returncode=1, wall_s=1.0, log=f"runs/{precision}-{mode}/log.txt")


def _run_script(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return run_script("scripts/compare_throughput.py", args, timeout=timeout)


# -- pure helpers ------------------------------------------------------------------------------


def test_summarize_drops_warmup_and_takes_medians():
    # Step 1 is the compile step: slow, and must only show up in first_step_s.
    records = [_record(1, 10.0, mem=3.0), _record(2, 50.0), _record(3, 100.0, mfu=40.0),
               _record(4, 300.0, mfu=50.0), _record(5, 200.0, loss=2.5, mfu=45.0)]
    s = cells.summarize_metrics(list(reversed(records)), warmup=2)
    assert s["tps"] == 200.0 and s["tflops"] == pytest.approx(0.2)
    assert s["mfu_pct"] == 45.0
    assert s["peak_memory_gib"] == 3.0  # max over every step, warm-up included
    assert s["first_step_s"] == pytest.approx(10.0)
    assert s["final_loss"] == 2.5 and s["steps_measured"] == 3


def test_summarize_mfu_null_on_cpu_and_no_steps_after_warmup():
    assert cells.summarize_metrics([_record(1, 5.0), _record(2, 7.0)], warmup=1)["mfu_pct"] is None
    with pytest.raises(ValueError, match="no steps after the 3 warm-up steps"):
        cells.summarize_metrics([_record(1, 5.0), _record(2, 7.0)], warmup=3)


def test_speedups_against_bf16_eager_and_same_compile():
    results = [_ok("bf16", "none", 100.0), _ok("tensorwise", "none", 50.0), _ok("bf16", "block", 200.0),
               _ok("tensorwise", "block", 300.0), _failed("rowwise", "block"), _ok("rowwise", "model", 120.0)]
    rep.add_speedups(results)
    by = {r.name: r for r in results}
    assert by["bf16-none"].speedup_vs_bf16_eager == 1.0 == by["bf16-none"].speedup_vs_bf16_same_compile
    assert by["tensorwise-none"].speedup_vs_bf16_eager == 0.5
    assert by["tensorwise-block"].speedup_vs_bf16_eager == 3.0
    assert by["tensorwise-block"].speedup_vs_bf16_same_compile == 1.5
    assert by["rowwise-block"].speedup_vs_bf16_eager is None  # failed
    assert by["rowwise-model"].speedup_vs_bf16_eager == 1.2
    assert by["rowwise-model"].speedup_vs_bf16_same_compile is None  # no bf16-model cell


def test_speedups_without_bf16_eager():
    results = [_failed("bf16", "none"), _ok("bf16", "block", 200.0), _ok("rowwise", "block", 100.0)]
    rep.add_speedups(results)
    assert results[2].speedup_vs_bf16_eager is None
    assert results[2].speedup_vs_bf16_same_compile == 0.5


def test_table_rows_and_failures():
    results = [_ok("bf16", "none", 1234.0), _ok("tensorwise", "none", 2468.0), _failed("rowwise", "none")]
    rep.add_speedups(results)
    table = rep.render_table(results)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert lines[0].count("|") == lines[2].count("|") == lines[4].count("|") == 11
    assert "| bf16 | none | 1,234 |" in table and "n/a" in lines[2]  # no MFU on CPU
    assert "| 2.00x | 2.00x |" in lines[3]
    assert lines[4].startswith("| rowwise | none | failed |")
    failures = rep.render_failures(results)
    assert "rowwise-none: RuntimeError: boom" in failures
    assert rep.render_failures(results[:2]) == ""


def test_markdown_has_table_failures_and_provenance():
    results = [_ok("bf16", "none", 100.0), _failed("tensorwise", "none")]
    rep.add_speedups(results)
    env = {"python": "3.11", "torch": "2.13.0", "cuda": None, "gpu": None, "cpu": "Some CPU", "os": "Linux"}
    info = {"command": "python scripts/compare_throughput.py --x", "date": "2025-01-01T00:00:00Z",
            "nproc": 1, "steps": 6, "warmup": 3, "environment": env}
    md = rep.render_markdown(results, info)
    assert rep.render_table(results) in md
    assert "tensorwise-none: RuntimeError: boom" in md
    assert "steps 4-6 of 6" in md and "`python scripts/compare_throughput.py --x`" in md
    assert "torch 2.13.0" in md and "Some CPU" in md and "2025-01-01" in md


@pytest.mark.parametrize(
    ("lines", "rc", "expected"),
    [
        # torchrun: the worker's exception, not the launcher's ChildFailedError summary
        (["[rank0]: Traceback (most recent call last):", '[rank0]:   File "train.py", line 3',
          "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
          "E1129 worker failed", "Traceback (most recent call last):",
          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
          "============================================================", "train.py FAILED",
          "  exitcode  : 1 (pid: 12)", "============================================================"],
         1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
        (["warning: float8 is slow", "error: training.seq_len must be positive, got 0"], 2,
         "error: training.seq_len must be positive, got 0"),
        (["Traceback (most recent call last):", "torch._dynamo.exc.InvalidBackend: Invalid backend: 'x'",
          "", "/usr/lib/python3/warnings.py:1: UserWarning: something"], 1,
         "torch._dynamo.exc.InvalidBackend: Invalid backend: 'x'"),
        (["loading shard 3", "warning: float8 is slow"], 1, "loading shard 3"),
        (["warning: float8 is slow", "====="], -9, "killed by signal 9 (out of host memory?)"),
        ([], 3, "exit code 3"),
    ],
)
def test_failure_reason(lines, rc, expected):
    assert cells.failure_reason([line + "\n" for line in lines], rc) == expected


def test_cell_overrides_win_over_user_and_config(tmp_path):
    base = ["--config", "configs/debug.toml", "--float8.fsdp_float8_all_gather", "true"]
    cfg = build_config([*base, *cells.cell_overrides("rowwise", "block", 5, str(tmp_path))])
    assert cfg.float8.enabled and cfg.float8.scaling == "rowwise"
    assert not cfg.float8.fsdp_float8_all_gather  # tensorwise and blockwise only, off for the other cells
    assert cfg.compile.mode == "block" and cfg.training.steps == 5 and cfg.metrics.log_freq == 1
    assert cfg.job.dump_folder == str(tmp_path) and cfg.job.run_name == "rowwise-block"
    assert not cfg.checkpoint.enable and not cfg.profiling.enable
    for recipe in ("tensorwise", "blockwise"):
        gathers = build_config([*base, *cells.cell_overrides(recipe, "none", 5, str(tmp_path))])
        assert gathers.float8.fsdp_float8_all_gather  # the user's choice stands where the recipe has it
    bf16 = build_config([*base, "--float8.enabled", "true", *cells.cell_overrides("bf16", "model", 5, "x")])
    assert not bf16.float8.enabled and bf16.compile.mode == "model"


def test_cell_overrides_set_the_float8_impl_only_when_asked(tmp_path):
    base = ["--config", "configs/debug.toml", "--float8.impl", "torchao"]
    cfg = build_config([*base, *cells.cell_overrides("tensorwise", "block", 5, "x", impl="ours")])
    assert cfg.float8.impl == "ours" and cfg.job.run_name == "tensorwise-block"
    cfg = build_config(["--config", "configs/debug.toml",
                        *cells.cell_overrides("rowwise", "none", 5, "x", impl="torchao")])
    assert cfg.float8.impl == "torchao" and cfg.job.run_name == "rowwise-torchao-none"
    # Without impl (loss_compare, gpu_check, bench_ac) the config's stands; bf16 has none.
    assert build_config([*base, *cells.cell_overrides("tensorwise", "none", 5, "x")]).float8.impl == "torchao"
    bf16 = cells.cell_overrides("bf16", "none", 5, "x", impl="torchao")
    assert "--float8.impl" not in bf16 and bf16[bf16.index("--job.run_name") + 1] == "bf16-none"
    assert [cells.precision_label(p, i) for p, i in (("bf16", "torchao"), ("rowwise", "ours"), ("rowwise", "torchao"))] \
        == ["bf16", "rowwise", "rowwise-torchao"]


def test_impls_run_every_float8_precision_per_implementation(tmp_path, monkeypatch):
    runs = []

    def fake_cell(precision, mode, cli, extras, out, train_py, impl):
        runs.append((precision, mode, impl))
        r = _ok(precision, mode, 100.0 if precision == "bf16" else {"ours": 150.0, "torchao": 140.0}[impl])
        r.impl, r.wall_s = impl, 1.0
        return r

    monkeypatch.setattr(ct, "run_cell", fake_cell)
    monkeypatch.setattr("trainer.float8_seam.reference.torchao_version", lambda asked_by: "9.9")
    out = tmp_path / "o"
    assert ct.main(["--config", "configs/debug.toml", "--out", str(out), "--steps", "4", "--impls", "ours,torchao",
                    "--precisions", "bf16,tensorwise,rowwise", "--compile", "none,block"]) == 0
    names = ["bf16-none", "tensorwise-none", "tensorwise-torchao-none", "rowwise-none", "rowwise-torchao-none"]
    names += [n.replace("-none", "-block") for n in names]
    assert [f"{cells.precision_label(p, i)}-{m}" for p, m, i in runs] == names
    assert [i for p, _, i in runs if p == "bf16"] == ["ours", "ours"]  # bf16 once per compile mode
    report = json.loads((out / "comparison.json").read_text())
    assert [c["name"] for c in report["cells"]] == names and report["impls"] == ["ours", "torchao"]
    assert report["torchao"] == "9.9" and report["cells"][2]["impl"] == "torchao"
    md = (out / "comparison.md").read_text()
    assert "| tensorwise-torchao | none | 140 |" in md and "| 1.40x | 1.40x |" in md
    assert "ran the recipe on the reference library torchao.float8" in md and ", torchao 9.9" in md
    run = rep.load_run(out / "comparison.json")
    assert [r.name for r in run.results] == names
    data = chart.chart_data([run])
    assert data.precisions == ["bf16", "tensorwise", "tensorwise-torchao", "rowwise", "rowwise-torchao"]
    assert data.bars[("tensorwise-torchao", "compile block")] == (140.0, "1.40x")


def test_missing_torchao_refuses_before_any_cell(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao` raise ImportError
    monkeypatch.setattr(ct, "run_cell", lambda *a: pytest.fail("a cell ran"))
    assert ct.main(["--config", "configs/debug.toml", "--out", str(tmp_path / "o"), "--impls", "ours,torchao",
                    "--precisions", "tensorwise"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --impls torchao needs the reference library torchao") and len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_result_files_without_impl_are_ours(tmp_path):
    path = _write_result(tmp_path / "old", [_ok("bf16", "none", 1.0), _ok("tensorwise", "none", 2.0)])
    data = json.loads(path.read_text())
    for c in data["cells"]:
        del c["impl"]  # written before --impls existed
    path.write_text(json.dumps(data))
    assert [(r.impl, r.name) for r in rep.load_run(path).results] == [("ours", "bf16-none"), ("ours", "tensorwise-none")]
    data["cells"][1]["impl"] = "fast"
    path.write_text(json.dumps(data))
    with pytest.raises(rep.ResultFileError, match=r"not a comparison\.json"):
        rep.load_run(path)


def _run(results: list, folder: str = "cmp") -> rep.Run:
    return rep.Run(Path(folder) / "comparison.json", results, {})


def test_chart_of_one_run(tmp_path):
    pytest.importorskip("matplotlib")
    results = [_ok("bf16", "none", 100.0), _ok("tensorwise", "none", 80.0), _ok("bf16", "block", 150.0),
               _failed("tensorwise", "block")]
    data = chart.chart_data([_run(results)])
    assert data.groups == ["compile none", "compile block"] and data.precisions == ["bf16", "tensorwise"]
    assert data.bars == {("bf16", "compile none"): (100.0, "1.00x"), ("tensorwise", "compile none"): (80.0, "0.80x"),
                         ("bf16", "compile block"): (150.0, "1.00x"), ("tensorwise", "compile block"): (0.0, "failed")}
    path = tmp_path / "c.png"
    assert chart.write_chart(data, path, "title")
    png = path.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000


def _write_result(folder: Path, results: list, **info) -> Path:
    folder.mkdir(parents=True)
    rep.add_speedups(results)
    info = {"config": "configs/7b_fp8.toml", "nproc": 2, "steps": 10, "warmup": 3,
            "environment": {"gpu": "NVIDIA H200"}, **info}
    (folder / "comparison.json").write_text(json.dumps(rep.report_json(results, info)))
    return folder / "comparison.json"


def test_chart_merges_a_compiled_and_an_eager_run(tmp_path, capsys, monkeypatch):
    # The docs' 7B chart: cells measured by two comparisons that do not overlap form one grid.
    pytest.importorskip("matplotlib")
    block = _write_result(tmp_path / "cmp_block", [_ok("bf16", "block", 11215.0), _ok("tensorwise", "block", 13903.0),
                                                   _ok("rowwise", "block", 12945.0)])
    eager = _write_result(tmp_path / "cmp_eager", [_ok("bf16", "none", 9246.0), _ok("tensorwise", "none", 8870.0)],
                          steps=7)
    data = chart.chart_data([rep.load_run(block), rep.load_run(eager)])
    assert not data.per_run and data.groups == ["compile none", "compile block"]
    assert data.precisions == ["bf16", "tensorwise", "rowwise"]
    assert data.bars == {
        ("bf16", "compile none"): (9246.0, "1.00x"), ("tensorwise", "compile none"): (8870.0, "0.96x"),
        ("bf16", "compile block"): (11215.0, "1.00x"), ("tensorwise", "compile block"): (13903.0, "1.24x"),
        ("rowwise", "compile block"): (12945.0, "1.15x"),
    }
    assert chart.chart_title([rep.load_run(block), rep.load_run(eager)]) == (
        "7b_fp8.toml: 2 x NVIDIA H200, steps 4-10\n7b_fp8.toml: 2 x NVIDIA H200, steps 4-7")
    out = tmp_path / "merged.png"
    titles = []
    monkeypatch.setattr(ct, "write_chart", lambda data, path, title: titles.append(title) or chart.write_chart(
        data, path, title))
    assert ct.main(["--chart", str(out), "--title", "LLaMA-2-7B", str(block), str(eager)]) == 0
    assert titles == ["LLaMA-2-7B"]
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert capsys.readouterr().out.strip() == (
        f"wrote {out}: 5 cells from 2 result file(s); groups: compile none; compile block")


def test_chart_keeps_runs_apart_when_they_measured_the_same_cells(tmp_path):
    # Batch 2 and batch 4: each run's float8 cell is compared with the bf16 cell of its own run.
    pytest.importorskip("matplotlib")
    b2 = _write_result(tmp_path / "b2", [_ok("bf16", "block", 100.0), _ok("tensorwise", "block", 125.0)])
    b4 = _write_result(tmp_path / "b4", [_ok("bf16", "block", 110.0), _ok("tensorwise", "block", 143.0),
                                          _ok("bf16", "none", 90.0)])
    runs = [rep.load_run(b2), rep.load_run(b4)]
    data = chart.chart_data(runs)
    assert data.per_run
    assert data.groups == ["compile none, b4", "compile block, b2", "compile block, b4"]
    assert data.bars == {
        ("bf16", "compile block, b2"): (100.0, "1.00x"), ("tensorwise", "compile block, b2"): (125.0, "1.25x"),
        ("bf16", "compile block, b4"): (110.0, "1.00x"), ("tensorwise", "compile block, b4"): (143.0, "1.30x"),
        ("bf16", "compile none, b4"): (90.0, "1.00x"),
    }
    named = chart.chart_data(runs, ["batch 2", "batch 4"])
    assert named.groups == ["compile none, batch 4", "compile block, batch 2", "compile block, batch 4"]
    assert ct.main(["--chart", str(tmp_path / "c.png"), "--labels", "batch 2,batch 4", str(b2), str(b4)]) == 0
    assert (tmp_path / "c.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--chart needs at least one comparison.json"),
        (["{missing}"], "no such file"),
        (["{not_json}"], "not JSON"),
        (["{not_comparison}"], "not a comparison.json"),
        (["{good}", "--config", "configs/debug.toml"], "--chart draws from result files and runs nothing"),
        (["{good}", "--labels", "a,b"], "--labels needs 1 distinct non-empty names"),
    ],
)
def test_chart_bad_input_one_line_exit_2(tmp_path, capsys, args, message):
    files = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "x.json",
             "not_comparison": tmp_path / "y.json", "good": _write_result(tmp_path / "g", [_ok("bf16", "none", 1.0)])}
    files["not_json"].write_text("{")
    files["not_comparison"].write_text(json.dumps({"cells": [{"precision": "fp4", "compile": "none", "ok": True}]}))
    argv = ["--chart", str(tmp_path / "c.png"), *(a.format(**files) for a in args)]
    assert ct.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c.png").exists()


def test_chart_without_matplotlib_is_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    stale = tmp_path / "comparison.png"
    stale.write_bytes(PNG_MAGIC)
    assert not chart.write_chart(chart.chart_data([_run([_ok("bf16", "none", 100.0)])]), stale, "title")
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not stale.exists()


def test_profile_step_traces_one_step_and_leaves_it_out_of_the_medians(tmp_path):
    cfg = build_config(["--config", "configs/debug.toml", *cells.cell_overrides("tensorwise", "block", 5, "x", 4)])
    assert cfg.profiling.enable and cfg.profiling.steps == [4]
    records = [_record(1, 10.0), _record(2, 100.0), _record(3, 110.0), _record(4, 20.0)]
    assert cells.summarize_metrics(records, 1, frozenset({4}))["tps"] == 105.0
    assert cells.summarize_metrics(records, 1, frozenset({4}))["steps_measured"] == 2
    trace = tmp_path / "profiles" / "step-4" / "rank-0.json"
    trace.parent.mkdir(parents=True)
    trace.write_text(json.dumps(synthetic_trace()))
    profile = cr.profile_of(tmp_path, 4)
    assert profile["classes"] == EXPECTED and profile["gpu_idle_ms"] == 5.0
    assert cr.profile_of(tmp_path, 3) == {"error": f"{tmp_path}/profiles/step-3/rank-0.json: no such file"}


def test_profiles_in_the_report(tmp_path, monkeypatch):
    def fake_cell(precision, mode, cli, *rest):
        assert cli.profile_step == 3
        r = _ok(precision, mode, 100.0 if precision == "bf16" else 150.0)
        r.wall_s = 1.0
        # bf16's trace is missing; tensorwise's is the synthetic GPU step.
        r.profile = cr.profile_of(tmp_path / "none", 3) if precision == "bf16" else traces.summarize(synthetic_trace())
        return r

    monkeypatch.setattr(ct, "run_cell", fake_cell)
    assert ct.main(["--config", "configs/debug.toml", "--out", str(tmp_path / "o"), "--steps", "4",
                    "--warmup", "1", "--profile-step", "3", "--precisions", "bf16,tensorwise", "--compile", "none"]) == 0
    md = (tmp_path / "o" / "comparison.md").read_text()
    assert "Profile of step 3, rank 0" in md and "profiled step 3 and the step after it left out" in md
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["tensorwise"] == ("| tensorwise | none | 13.00 (2) | 4.00 (1) | 3.00 (3) | 2.00 (1) | 3.00 (2) "
                                  "| 1.00 (1) | 0.00 (0) | 13.50 (3) | 6.00 | 5.00 | 40.00 |")
    assert rows["bf16"].startswith("| bf16 | none | no trace: ") and "no such file" in rows["bf16"]
    report = json.loads((tmp_path / "o" / "comparison.json").read_text())
    assert report["profile_step"] == 3
    assert report["cells"][1]["profile"]["classes"] == EXPECTED


def test_event_files_are_copied_without_the_hostname(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    name = f"events.out.tfevents.1700000000.{socket.gethostname()}.123.0"
    (src / name).write_bytes(b"events")
    cr.copy_events(src, tmp_path / "dst")
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["events.out.tfevents.1700000000.host.123.0"]
    cr.copy_events(tmp_path / "missing", tmp_path / "none")  # a run that died before TensorBoard started
    assert not (tmp_path / "none").exists()


def test_all_cells_failed_exits_1_and_still_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ct, "run_cell", lambda p, m, *a: _failed(p, m, "RuntimeError: no luck"))
    rc = ct.main(["--config", "configs/debug.toml", "--out", str(tmp_path), "--steps", "2",
                  "--precisions", "bf16,rowwise", "--compile", "none"])
    assert rc == 1
    report = json.loads((tmp_path / "comparison.json").read_text())
    assert report["failures"] == {"bf16-none": "RuntimeError: no luck", "rowwise-none": "RuntimeError: no luck"}
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("| rowwise | none | failed |")  # the table comes last


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precisions", "bf16,fp4"], "--precisions: unknown name 'fp4'"),
        (["--compile", "none,fast"], "--compile: unknown name 'fast'"),
        (["--precisions", ","], "--precisions needs at least one of"),
        (["--steps", "3", "--warmup", "3"], "--warmup must be in [0, steps)"),
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--oops"], "unrecognized arguments: --oops"),
        (["--", "--compile.mode", "block"], "--compile.mode is set for each cell by this script"),
        (["--", "--config", "configs/7b_fp8.toml"], "pass --config before `--`"),
        (["--", "--training.bach_size", "2"], "unknown config key training.bach_size (did you mean 'batch_size'?)"),
        (["--steps", "3", "--warmup", "2", "--profile-step", "3"], "--profile-step must be a step in [1, 3]"),
        (["--profile-step", "0"], "--profile-step must be a step in [1, 20]"),
        (["--", "--profiling.steps", "2"], "--profiling.steps is set for each cell by this script"),
        (["results.json"], "result files, --labels and --title are read only with --chart"),
        (["--title", "x"], "result files, --labels and --title are read only with --chart"),
        (["--impls", "ours,fast"], "--impls: unknown name 'fast' (choose from ours, torchao)"),
        (["--", "--float8.impl", "torchao"], "--float8.impl is set for each cell by this script; use --impls"),
        # train.py's own refusal, checked for the torchao cells before any cell runs
        (["--impls", "torchao", "--", "--float8.filter", "auto"], "float8.filter = 'auto' times this repository's"),
    ],
)
def test_bad_arguments_one_line_exit_2(args, message, tmp_path, capsys):
    cut = args.index("--") if "--" in args else len(args)
    argv = [*args[:cut], "--config", "configs/debug.toml", "--out", str(tmp_path / "o"), *args[cut:]]
    assert ct.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing ran


def test_bad_arguments_from_the_command_line(tmp_path):
    result = _run_script(["--config", "configs/missing.toml", "--out", str(tmp_path)])
    assert result.returncode == 2
    assert result.stderr.strip() == "error: config file not found: configs/missing.toml"
    result = _run_script(["--config", "configs/debug.toml"])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--out" in result.stderr and "Traceback" not in result.stderr


# -- end to end on CPU -------------------------------------------------------------------------


@pytest.mark.slow
def test_reduced_comparison_on_cpu(tmp_path):
    out = tmp_path / "cmp"
    # The harness is under test, not inductor (tests/trainer/distributed/test_parallel.py compiles with it): aot_eager
    # traces the same blocks without inductor's C++ compiles, a minute of the cores.
    result = _run_script(["--config", "configs/debug.toml", "--steps", "3", "--precisions", "bf16,tensorwise",
                          "--compile", "none,block", "--out", str(out), "--", *TINY, "--compile.backend", "aot_eager"])
    assert result.returncode == 0, result.stdout + result.stderr
    cells = ["bf16-none", "tensorwise-none", "bf16-block", "tensorwise-block"]

    md = (out / "comparison.md").read_text()
    for cell in cells:
        precision, mode = cell.split("-")
        assert f"| {precision} | {mode} | " in md
    assert "failed" not in md
    assert result.stdout.rstrip().endswith(md.split("\n\n")[1].rstrip())  # the table is printed last

    report = json.loads((out / "comparison.json").read_text())
    assert [c["name"] for c in report["cells"]] == cells
    assert report["failures"] == {} and report["environment"]["torch"]
    by = {c["name"]: c for c in report["cells"]}
    for c in by.values():
        assert c["ok"] and c["tps"] > 0 and c["tflops"] > 0 and c["mfu_pct"] is None
        assert c["steps_measured"] == 1 and c["first_step_s"] > 0 and c["peak_memory_gib"] > 0
        assert c["speedup_vs_bf16_eager"] == pytest.approx(c["tps"] / by["bf16-none"]["tps"])
        assert c["speedup_vs_bf16_same_compile"] == pytest.approx(c["tps"] / by[f"bf16-{c['compile']}"]["tps"])
        assert "--training.batch_size 2" in c["command"] and f"--job.run_name {c['name']}" in c["command"]
    assert by["bf16-none"]["speedup_vs_bf16_eager"] == 1.0

    # Same seed and data in every cell: the first step sees the same weights and batch.
    first_losses = [json.loads((out / "runs" / c / "metrics.jsonl").read_text().splitlines()[0])["loss"]
                    for c in cells]
    assert max(first_losses) - min(first_losses) < 0.05 * min(first_losses)

    png = (out / "comparison.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    for cell in cells:
        events = list((out / "tb" / cell).glob("events.out.tfevents.*"))
        assert events and all(f".{socket.gethostname()}." not in e.name for e in events), cell
        assert "step" in (out / "runs" / cell / "log.txt").read_text()


@pytest.mark.slow
def test_ours_and_torchao_side_by_side_on_cpu(tmp_path):
    # Emulated GEMMs (float8.emulate, torchao's own too): on CPUs with AMX torchao's torch._scaled_mm
    # takes seconds per GEMM (docs/float8/library.md, "On CPU"); the casts, scales and cells are real.
    pytest.importorskip("torchao.float8")
    out = tmp_path / "cmp"
    result = _run_script(["--config", "configs/debug.toml", "--steps", "3", "--precisions", "bf16,tensorwise",
                          "--compile", "none", "--impls", "ours,torchao", "--out", str(out), "--", *TINY,
                          "--float8.emulate", "true"])
    assert result.returncode == 0, result.stdout + result.stderr
    names = ["bf16-none", "tensorwise-none", "tensorwise-torchao-none"]
    report = json.loads((out / "comparison.json").read_text())
    assert [c["name"] for c in report["cells"]] == names and report["failures"] == {}
    by = {c["name"]: c for c in report["cells"]}
    assert "--float8.impl torchao" in by["tensorwise-torchao-none"]["command"]
    assert "--float8.impl ours" in by["tensorwise-none"]["command"] and "--float8.impl" not in by["bf16-none"]["command"]
    assert "precision float8 tensorwise (torchao " in (out / "runs" / "tensorwise-torchao-none" / "log.txt").read_text()
    md = (out / "comparison.md").read_text()
    assert "| tensorwise-torchao | none | " in md and f"torchao {report['torchao']}" in md
    # Same seed and data, the same recipe: the first step's losses agree closely.
    first = [json.loads((out / "runs" / n / "metrics.jsonl").read_text().splitlines()[0])["loss"] for n in names[1:]]
    assert abs(first[0] - first[1]) < 1e-3 * first[0]
    for name in names:
        assert list((out / "tb" / name).glob("events.out.tfevents.*")), name


@pytest.mark.slow
def test_failed_cell_is_recorded_and_others_run(tmp_path):
    # A backend of torch's that fails on every compiled block breaks only the compiled cell; eager
    # never reads it. Two processes, so the reason must come from the worker's traceback, not
    # torchrun's summary after it.
    out = tmp_path / "cmp"
    result = _run_script(["--config", "configs/debug.toml", "--nproc", "2", "--steps", "2", "--precisions", "bf16",
                          "--compile", "block,none", "--out", str(out), "--", *TINY,
                          "--compile.backend", "non_leaf_compile_error_TESTING_ONLY"])
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((out / "comparison.json").read_text())
    by = {c["name"]: c for c in report["cells"]}
    assert not by["bf16-block"]["ok"] and by["bf16-block"]["returncode"] != 0
    assert by["bf16-block"]["reason"].startswith(
        "error: unexpected BackendCompilerFailed: backend='non_leaf_compile_error_TESTING_ONLY'")
    assert "torch.distributed.run --standalone --nproc_per_node=2" in by["bf16-none"]["command"]
    assert report["failures"] == {"bf16-block": by["bf16-block"]["reason"]}
    assert by["bf16-none"]["ok"] and by["bf16-none"]["speedup_vs_bf16_eager"] == 1.0
    md = (out / "comparison.md").read_text()
    assert "| bf16 | block | failed |" in md and "bf16-block: " in md
    assert "FAILED" in result.stdout
    assert Path(by["bf16-block"]["log"]).read_text().count("non_leaf_compile_error_TESTING_ONLY") >= 1


@pytest.mark.slow
def test_profiled_cell_on_cpu(tmp_path):
    out = tmp_path / "cmp"
    result = _run_script(["--config", "configs/debug.toml", "--steps", "4", "--warmup", "1", "--profile-step", "2",
                          "--precisions", "tensorwise", "--compile", "none", "--out", str(out), "--", *TINY])
    assert result.returncode == 0, result.stdout + result.stderr
    cell = json.loads((out / "comparison.json").read_text())["cells"][0]
    # Step 4: step 2 was traced, and the profiler's stop waited for the device inside step 3's period.
    assert cell["ok"] and cell["steps_measured"] == 1
    assert "--profiling.enable true --profiling.steps 2" in cell["command"]
    profile = cell["profile"]
    assert profile["device"] == "cpu" and "gpu_idle_ms" not in profile
    # The debug model's float8 linears: GEMMs and casts, and AdamW under Optimizer.step.
    for cls in ("gemm", "float8", "optimizer", "elementwise"):
        assert profile["classes"][cls]["count"] > 0 and profile["classes"][cls]["ms"] > 0, cls
    assert "Profile of step 2, rank 0" in (out / "comparison.md").read_text()
