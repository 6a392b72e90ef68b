"""scripts/loss_compare.py and its parts (scripts/harness/loss/: report, chart): the numbers on hand-made series,
the float8 health section, merging parts and its refusals, argument errors, and one CPU run."""

from __future__ import annotations

import importlib.util
import json
import socket

import pytest

from scripts import loss_compare as lc
from scripts.harness.compare import run as cr
from scripts.harness.loss import report as lr
from scripts.harness.loss import seeds as ls
from tests.helpers import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- the numbers ---------------------------------------------------------------------------------


def test_tail_mean_is_the_last_ten_percent_of_steps_at_least_one():
    steps = list(range(1, 21))
    assert lr.tail_steps(20) == 2 and lr.tail_steps(6) == 1 and lr.tail_steps(1000) == 100
    assert lr.tail_mean(steps, [float(s) for s in steps], 20) == 19.5
    assert lr.tail_mean(steps[:6], [float(s) for s in steps[:6]], 6) == 6.0
    assert lr.tail_mean([1, 2, 3], [1.0, 2.0, None], 3) is None  # the last step's loss was not finite
    assert lr.tail_mean([1, 2, 3, 4], [1.0, 2.0, 3.0, 4.0], 25) is None  # nothing logged in steps 24-25
    assert lr.tail_mean(steps, [float(s) for s in steps[:19]] + [float("nan")], 20) == 19.0


def test_relative_gap_is_signed_and_relative_to_bf16():
    assert lr.relative_gap_pct(4.04, 4.0) == pytest.approx(1.0)
    assert lr.relative_gap_pct(3.96, 4.0) == pytest.approx(-1.0)
    assert lr.relative_gap_pct(4.0, None) is None and lr.relative_gap_pct(None, 4.0) is None
    assert lr.relative_gap_pct(1.0, 0.0) is None


def test_moving_window_worst_gap_and_its_step():
    steps = [1, 2, 3, 4]
    base = lr.moving_average(steps, [4.0, 4.0, 4.0, 4.0], 2)
    assert base == {2: 4.0, 3: 4.0, 4: 4.0}
    up = lr.moving_average(steps, [4.0, 4.4, 4.0, 4.0], 2)
    assert up == pytest.approx({2: 4.2, 3: 4.2, 4: 4.0})
    assert lr.worst_window_gap(base, up) == (pytest.approx(5.0), 2)  # the first of equal gaps
    down = lr.moving_average(steps, [4.2, 4.0, 3.6, 4.0], 2)  # 4.1, 3.8, 3.8: -5 % beats +2.5 %
    assert lr.worst_window_gap(base, down) == (pytest.approx(-5.0), 3)
    assert lr.moving_average(steps, [4.0, None, 4.0, 2.0], 2) == {3: 4.0, 4: 3.0}  # skips the null loss
    assert lr.worst_window_gap(base, {}) is None


def _run(precision: str, losses: list[float], val: dict[int, float], ok: bool = True) -> dict:
    return {"name": f"{precision}-none", "precision": precision, "compile": "none", "ok": ok, "reason": None,
            "log": "log.txt", "tps": 100.0, "warmup": 3, "train_steps": list(range(1, len(losses) + 1)),
            "train_loss": losses, "validation_loss": {str(s): x for s, x in val.items()}, "health": None}


def test_run_stats_gaps_and_validation_gaps():
    base = _run("bf16", [5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0], {5: 4.0, 10: 2.0})
    fp8 = _run("tensorwise", [5.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.4, 4.0, 4.02], {5: 4.2, 10: 1.99})
    stats = lr.run_stats(fp8, base, 10, 2)
    assert stats["train_loss_tail"] == 4.02 and stats["train_gap_pct"] == pytest.approx(0.5)
    assert stats["worst_window_gap_pct"] == pytest.approx(5.0) and stats["worst_window_step"] == 8
    assert stats["validation_gap_pct"] == {"5": pytest.approx(5.0), "10": pytest.approx(-0.5)}
    assert stats["final_validation_step"] == 10 and stats["final_validation_loss"] == 1.99
    assert stats["final_validation_gap_pct"] == pytest.approx(-0.5)
    alone = lr.run_stats(fp8, None, 10, 2)  # no bf16: numbers, no gaps
    assert alone["train_loss_tail"] == 4.02 and alone["train_gap_pct"] is None
    assert alone["validation_gap_pct"] == {} and alone["worst_window_step"] is None


@pytest.mark.parametrize(("train", "val", "within", "text"), [
    (0.25, -0.1, True, "tensorwise: within ±0.5 % of bf16: final training loss +0.25 %, "
                       "final held-out loss -0.10 % at step 6"),
    (0.8, 0.2, False, "tensorwise: NOT within ±0.5 % of bf16: final training loss +0.80 % (outside), "
                      "final held-out loss +0.20 % at step 6 (within)"),
    (-0.1, -0.7, False, "tensorwise: NOT within ±0.5 % of bf16: final training loss -0.10 % (within), "
                        "final held-out loss -0.70 % at step 6 (outside)"),
    (0.1, None, True, "tensorwise: within ±0.5 % of bf16: final training loss +0.10 %; no held-out loss "
                      "to compare (validation off, or not evaluated in both runs)"),
    (None, None, None, "tensorwise: no verdict: no final training loss to compare"),
])
def test_verdict_says_which_loss_is_outside(train, val, within, text):
    stats = {"train_gap_pct": train, "final_validation_gap_pct": val, "final_validation_step": 6}
    assert lr.verdict("tensorwise", stats, 0.5) == (within, text)


def test_validation_columns_are_every_evaluation_if_few_else_the_last():
    few = {"runs": [_run("bf16", [1.0], {3: 2.0, 6: 1.5}), _run("tensorwise", [1.0], {3: 2.0, 6: 1.4, 9: 1.3})]}
    assert lr.validation_columns(few) == ([3, 6, 9], 3)
    many = {"runs": [_run("bf16", [1.0], {s: 1.0 for s in range(10, 101, 10)})]}
    assert lr.validation_columns(many) == ([100], 10)
    report = lr.build_report({"steps": 100, "window": 5, "tolerance": 0.5}, many["runs"])
    assert "| held-out @ 100 (last of 10) |" in lr.render_table(report)


HEALTH_OLD = {"float8/worst/input/underflow": 0.9, "float8/worst/input/underflow/layer": "old"}
HEALTH_LAST = {
    "float8/worst/input/underflow": 0.001, "float8/worst/input/underflow/layer": "layers.0.attention.wq",
    "float8/worst/input/saturation": 0, "float8/worst/input/saturation/layer": "layers.1.feed_forward.w2",
    "float8/worst/input/saturation_norm_share": 1e-20,
    "float8/worst/input/saturation_norm_share/layer": "layers.0.attention.wq",
    "float8/worst/grad_output/underflow_norm_share": 1.5e-18,
    "float8/worst/grad_output/underflow_norm_share/layer": "layers.1.feed_forward.w2",
    "float8/worst/grad_output/underflow": 0.25, "float8/worst/grad_output/underflow/layer": "layers.1.feed_forward.w2",
    "float8/worst/grad_output/amax_growth": 3.5, "float8/worst/grad_output/amax_growth/layer": "layers.0.feed_forward.w1",
    "float8/worst/weight/amax_growth": 1.2, "float8/worst/weight/amax_growth/layer": "output",
    # What a tolerant reader skips: a value that is not a number, a key of another shape, a layer alone.
    "float8/worst/weight/underflow": "n/a", "float8/worst/bogus": 1.0, "float8/worst/weight/scale/layer": "x",
}


def test_health_comes_from_the_last_record_that_has_it():
    records = [{"step": 5, "loss": 1.0, **HEALTH_OLD}, {"step": 10, "loss": 1.0, **HEALTH_LAST},
               {"step": 11, "loss": 1.0}]
    health = lr.health_of(records)
    assert health == {"step": 10, "operands": {
        "input": {"underflow": {"value": 0.001, "layer": "layers.0.attention.wq"},
                  "saturation": {"value": 0.0, "layer": "layers.1.feed_forward.w2"},
                  "saturation_norm_share": {"value": 1e-20, "layer": "layers.0.attention.wq"}},
        "grad_output": {"underflow": {"value": 0.25, "layer": "layers.1.feed_forward.w2"},
                        "underflow_norm_share": {"value": 1.5e-18, "layer": "layers.1.feed_forward.w2"},
                        "amax_growth": {"value": 3.5, "layer": "layers.0.feed_forward.w1"}},
        "weight": {"amax_growth": {"value": 1.2, "layer": "output"}},
    }}
    assert lr.health_of([{"step": 1, "loss": 1.0, "float8/other": 2.0}]) is None
    report = {"runs": [{**_run("tensorwise", [1.0], {}), "health": health}]}
    assert lr.render_health(report).splitlines()[-4:] == [
        "| tensorwise | 10 | input | 0.1 % | layers.0.attention.wq | - | - | 0 % | layers.1.feed_forward.w2 | 1e-20 "
        "| layers.0.attention.wq |",
        "| tensorwise | 10 | grad_output | 25 % | layers.1.feed_forward.w2 | 1.5e-18 | layers.1.feed_forward.w2 "
        "| - | - | - | - |",
        "",
        "Largest amax growth: tensorwise: 3.50 (grad_output, layers.0.feed_forward.w1).",
    ]
    assert lr.render_health({"runs": [_run("tensorwise", [1.0], {})]}) == ""


# -- runs (faked) and merging --------------------------------------------------------------------


def _losses(precision: str, steps: int) -> list[float]:
    base = [5.0 - 0.1 * s for s in range(1, steps + 1)]
    if precision == "tensorwise":  # +0.01 everywhere, +0.2 at step 5
        return [x + (0.2 if s == 5 else 0.01) for s, x in enumerate(base, 1)]
    return base


VALIDATION = {"bf16": {5: 5.0, 10: 4.5}, "tensorwise": {5: 5.05, 10: 4.5}}


def _fake_run_cell(precision, mode, cli, extras, out, train_py, seed=None):
    r = cr.CellResult(precision, mode, seed=seed, command=f"python train.py --{precision}", wall_s=1.0)
    run_dir = out / "runs" / r.name
    run_dir.mkdir(parents=True)
    r.log = str(run_dir / "log.txt")
    if precision == "rowwise":
        r.reason, r.returncode = "RuntimeError: boom", 1
        return r
    records = []
    for step, loss in enumerate(_losses(precision, cli.steps), 1):
        record = {"step": step, "loss": loss, "tps": 1.0, "float8/other/key": 1.0}
        if step in VALIDATION[precision]:
            record["validation/loss"] = VALIDATION[precision][step]
        if precision == "tensorwise" and step in (5, 10):
            record.update(HEALTH_OLD if step == 5 else HEALTH_LAST)
        records.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    r.ok, r.tps, r.final_loss = True, 100.0 if precision == "bf16" else 150.0, records[-1]["loss"]
    return r


@pytest.fixture
def parts(tmp_path, monkeypatch, capsys):
    """Three parts run one precision each (rowwise fails), as a session of limited length would."""
    monkeypatch.setattr(lc, "run_cell", _fake_run_cell)
    found = {}
    for precision in ("bf16", "tensorwise", "rowwise"):
        out = tmp_path / precision
        rc = lc.main(["--config", "configs/debug.toml", "--steps", "10", "--precisions", precision,
                      "--compile", "none", "--out", str(out), "--", "--training.batch_size", "2"])
        assert rc == (1 if precision == "rowwise" else 0)
        found[precision] = out / "loss_compare.json"
    capsys.readouterr()
    return found


def test_a_part_without_bf16_lists_its_run_without_gaps(parts, capsys):
    md = (parts["tensorwise"].parent / "loss_compare.md").read_text()
    assert "| tensorwise | 4.0100 | n/a | n/a | 5.0500 | 4.5000 | 150 |" in md
    assert "bf16 is missing" in md and "tensorwise: no verdict: bf16 is missing" in md
    assert "## Float8 health" in md
    report = json.loads(parts["tensorwise"].read_text())
    run = report["runs"][0]
    assert run["train_steps"] == list(range(1, 11)) and len(run["train_loss"]) == 10
    assert run["validation_loss"] == {"5": 5.05, "10": 4.5} and run["health"]["step"] == 10
    assert report["window"] == 1 and report["tolerance"] == 0.5 and report["compile"] == "none"
    assert report["train_overrides"] == ["--training.batch_size", "2"]
    failed = json.loads(parts["rowwise"].read_text())
    assert failed["failures"] == {"rowwise-none": "RuntimeError: boom"}


def test_merge_rebuilds_the_report_with_gaps(parts, tmp_path, capsys):
    out = tmp_path / "merged"
    assert lc.main(["--merge", *(str(parts[p]) for p in ("tensorwise", "bf16", "rowwise")),
                    "--window", "2", "--out", str(out)]) == 0
    md = (out / "loss_compare.md").read_text()
    assert "| bf16 | 4.0000 | baseline | - | 5.0000 | 4.5000 | 100 |" in md
    assert "| tensorwise | 4.0100 | +0.25 % | +2.36 % @ step 6 | 5.0500 (+1.00 %) | 4.5000 (+0.00 %) | 150 (1.50x) |" in md
    assert "| rowwise | failed |" in md and "rowwise-none: RuntimeError: boom" in md
    assert ("- tensorwise: within ±0.5 % of bf16: final training loss +0.25 %, final held-out loss "
            "+0.00 % at step 10") in md
    assert "- rowwise: no verdict: the run failed" in md and "Largest amax growth: tensorwise: 3.50" in md
    assert md.count("- part ") == 3
    report = json.loads((out / "loss_compare.json").read_text())
    assert [r["precision"] for r in report["runs"]] == ["bf16", "tensorwise", "rowwise"]
    assert report["verdicts"]["tensorwise"]["within"] is True and report["window"] == 2
    assert report["runs"][1]["stats"]["worst_window_step"] == 6
    assert [p["precisions"] for p in report["parts"]] == [["tensorwise"], ["bf16"], ["rowwise"]]
    if importlib.util.find_spec("matplotlib"):
        assert (out / "loss_compare.png").read_bytes().startswith(PNG_MAGIC)
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("| rowwise | failed |")  # the table comes last
    # A second merge into the same folder keeps the first one's files.
    assert lc.main(["--merge", str(parts["bf16"]), str(parts["tensorwise"].parent), "--out", str(out)]) == 0
    assert (out / "previous-1" / "loss_compare.md").read_text() == md


def test_merge_refusals_one_line_exit_2(parts, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lc, "run_cell", _fake_run_cell)
    longer = tmp_path / "longer"
    assert lc.main(["--config", "configs/debug.toml", "--steps", "12", "--precisions", "tensorwise",
                    "--compile", "none", "--out", str(longer), "--", "--training.batch_size", "2"]) == 0
    capsys.readouterr()
    bf16, tw, rw = (str(parts[p]) for p in ("bf16", "tensorwise", "rowwise"))
    cases = [
        ([bf16, str(longer / "loss_compare.json")], "disagree on steps (10 vs 12)"),
        ([bf16, tw, bf16], f"--merge: bf16 appears twice ({bf16} and {bf16})"),
        ([tw, rw], "--merge: no part has a bf16 run, so there is nothing to compare against"),
        ([bf16, str(tmp_path / "nothing.json")], "nothing.json: no such file"),
        ([bf16, "--config", "configs/debug.toml", "--precisions", "bf16"],
         "--merge rebuilds the report from its parts and runs nothing: drop --config, --precisions"),
        ([bf16, "--", "--training.steps", "3"], "drop the train.py arguments after `--`"),
    ]
    for args, message in cases:
        out = tmp_path / "refused"
        cut = args.index("--") if "--" in args else len(args)
        assert lc.main(["--merge", *args[:cut], "--out", str(out), *args[cut:]]) == 2, message
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_all_runs_failed_exits_1_and_an_earlier_comparison_is_kept(tmp_path, monkeypatch, capsys):
    (tmp_path / "loss_compare.md").write_text("earlier")
    (tmp_path / "runs" / "x").mkdir(parents=True)
    monkeypatch.setattr(lc, "run_cell", _fake_run_cell)
    assert lc.main(["--config", "configs/debug.toml", "--steps", "4", "--precisions", "rowwise",
                    "--out", str(tmp_path)]) == 1
    assert (tmp_path / "previous-1" / "loss_compare.md").read_text() == "earlier"
    assert (tmp_path / "previous-1" / "runs" / "x").is_dir()
    out = capsys.readouterr().out
    assert "rowwise-block failed: RuntimeError: boom" in out
    assert out.rstrip().splitlines()[-1].startswith("| rowwise | failed |")


# -- argument errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["--precisions", "bf16,fp4"], "--precisions: unknown name 'fp4'"),
    (["--compile", "none,block"], "--compile takes one mode of none, block, model, got 'none,block'"),
    (["--steps", "3", "--warmup", "3"], "--warmup must be in [0, steps)"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--nproc", "0"], "--nproc must be >= 1"),
    (["--window", "0"], "--window must be >= 1"),
    (["--steps", "10", "--window", "11"], "--window must be at most --steps (10), got 11"),
    (["--tolerance", "-1"], "--tolerance must be a positive percentage"),
    (["--oops"], "unrecognized arguments: --oops"),
    (["--", "--training.steps", "5"], "--training.steps is set for each run by this script"),
    (["--", "--metrics.log_freq", "5"], "--metrics.log_freq is set for each run by this script"),
    (["--", "--config", "configs/7b_fp8.toml"], "pass --config before `--`"),
    (["--", "--training.bach_size", "2"], "unknown config key training.bach_size (did you mean 'batch_size'?)"),
])
def test_bad_arguments_one_line_exit_2(args, message, tmp_path, capsys):
    cut = args.index("--") if "--" in args else len(args)
    argv = [*args[:cut], "--config", "configs/debug.toml", "--out", str(tmp_path / "o"), *args[cut:]]
    assert lc.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # nothing ran


@pytest.mark.parametrize(("argv", "message"), [
    (["--out", "o"], "required: --config"),
    (["--config", "configs/debug.toml"], "required: --out"),
    (["--config", "configs/missing.toml", "--out", "o"], "config file not found: configs/missing.toml"),
])
def test_missing_arguments(argv, message, capsys):
    assert lc.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


# -- seeds: bf16's noise band and the paired gaps --------------------------------------------------


def _seeded(precision: str, seed: int, tail: float, heldout: float) -> dict:
    """A 10-step run whose last step (the last 10 %) has loss `tail`, evaluated once at step 10."""
    return {**_run(precision, [5.0] * 9 + [tail], {10: heldout}), "seed": seed,
            "name": f"{precision}-none-seed{seed}"}


def _seed_report(tensorwise: dict[int, float], rowwise: dict[int, float]) -> dict:
    # bf16's held-out losses 3.00, 3.02, 3.04 at seeds 1-3: spread (sample sd) 0.02 nats.
    runs = [_seeded("bf16", s, 4.0 + s / 100, 3.0 + (s - 1) / 50) for s in (1, 2, 3)]
    runs += [_seeded("tensorwise", s, 4.0 + s / 100, 3.0 + (s - 1) / 50 + g) for s, g in tensorwise.items()]
    runs += [_seeded("rowwise", s, 4.0 + s / 100, 3.0 + (s - 1) / 50 + g) for s, g in rowwise.items()]
    return lr.build_report({"steps": 10, "window": 1, "tolerance": 0.5}, runs)


def test_seed_band_paired_gaps_and_verdict_words():
    report = _seed_report({1: 0.01, 2: 0.03, 3: 0.02}, {1: -0.05, 2: -0.03})
    assert report["seeds"] == [1, 2, 3] and report["noise_metric"] == "heldout"
    assert report["bf16_seed_spread_nats"] == pytest.approx(0.02)
    tw = report["recipes"]["tensorwise"]
    assert tw["gap_nats"] == {"mean": pytest.approx(0.02), "spread": pytest.approx(0.01)}
    assert tw["heldout"]["per_seed_nats"] == pytest.approx({"1": 0.01, "2": 0.03, "3": 0.02})
    assert tw["gap_pct"]["mean"] == pytest.approx(100 * (0.01 / 3.0 + 0.03 / 3.02 + 0.02 / 3.04) / 3)
    assert tw["train"]["mean_nats"] == pytest.approx(0.0) and report["bf16_seed_spread_by_metric_nats"]["train"] \
        == pytest.approx(0.01)
    assert report["verdicts"]["tensorwise"]["within"] is True
    assert report["verdicts"]["tensorwise"]["text"].startswith(
        "tensorwise: within bf16's seed noise: held-out loss (mean of the last 5 evaluations) gap "
        "+0.0200 ± 0.0100 nats (+0.66 ± 0.33 %) over 3 seed(s); bf16's seed spread 0.0200 nats")
    assert report["verdicts"]["rowwise"]["text"].startswith("rowwise: better by 0.0400 ± 0.0141 nats:")
    worse = _seed_report({1: 0.05, 2: 0.03}, {})
    assert worse["verdicts"]["tensorwise"]["text"].startswith("tensorwise: worse by 0.0400 ± 0.0141 nats:")
    assert worse["verdicts"]["tensorwise"]["verdict"] == "worse"
    md = lr.render_markdown({**worse, "environment": {"torch": "x", "python": "y"}, "command": "c", "date": "d",
                             "nproc": 1, "config": "c.toml", "compile": "none"})
    assert "## Against bf16's seed noise" in md
    assert "| tensorwise | held-out loss (mean of the last 5 evaluations) | 0.0200 nats | +0.0400 ± 0.0141 |" in md
    assert "| tensorwise seed 2 | 4.0200 | +0.00 % |" in md  # each run against bf16 of its own seed
    one = lr.build_report({"steps": 10, "window": 1, "tolerance": 0.5},
                          [_seeded("bf16", 1, 4.0, 3.0), _seeded("tensorwise", 1, 4.0, 3.1)])
    assert one["verdicts"]["tensorwise"]["text"].startswith("tensorwise: no noise band (bf16 ran at fewer than 2")


def test_merge_of_per_seed_parts_and_its_refusals(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lc, "run_cell", _fake_run_cell)
    made = {}
    for precision, seeds, steps in (("bf16", "1,2", 10), ("tensorwise", "1", 10), ("tensorwise", "2", 10),
                                    ("bf16", "2", 12)):
        out = tmp_path / f"{precision}-{seeds}-{steps}"
        assert lc.main(["--config", "configs/debug.toml", "--steps", str(steps), "--precisions", precision,
                        "--seeds", seeds, "--compile", "none", "--out", str(out)]) == 0
        made[(precision, seeds, steps)] = str(out / "loss_compare.json")
    capsys.readouterr()
    out = tmp_path / "merged"
    parts = [made[("bf16", "1,2", 10)], made[("tensorwise", "1", 10)], made[("tensorwise", "2", 10)]]
    assert lc.main(["--merge", *parts, "--out", str(out)]) == 0
    report = json.loads((out / "loss_compare.json").read_text())
    assert [r["name"] for r in report["runs"]] == ["bf16-none-seed1", "bf16-none-seed2",
                                                   "tensorwise-none-seed1", "tensorwise-none-seed2"]
    assert report["seeds"] == [1, 2] and report["bf16_seed_spread_nats"] == 0.0  # the fake's losses ignore seeds
    # Held-out (5.05 + 4.5) / 2 vs (5.0 + 4.5) / 2 at both seeds.
    assert report["recipes"]["tensorwise"]["gap_nats"] == {"mean": pytest.approx(0.025), "spread": pytest.approx(0)}
    assert [p["precisions"] for p in report["parts"]] == [["bf16 seed 1", "bf16 seed 2"], ["tensorwise seed 1"],
                                                          ["tensorwise seed 2"]]
    for args, message in (
        ([parts[0], made[("bf16", "2", 12)]], "disagree on steps (10 vs 12)"),
        ([parts[0], parts[1], parts[1]], f"--merge: tensorwise seed 1 appears twice ({parts[1]} and {parts[1]})"),
    ):
        assert lc.main(["--merge", *args, "--out", str(tmp_path / "refused")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1, err
    assert lc.main(["--config", "configs/debug.toml", "--seeds", "1,x", "--out", str(tmp_path / "o")]) == 2
    assert "--seeds takes a comma list of integers, got '1,x'" in capsys.readouterr().err
    assert lc.main(["--config", "configs/debug.toml", "--seeds", "1", "--out", str(tmp_path / "o"), "--",
                    "--training.seed", "3"]) == 2
    assert "--training.seed is set for each run by --seeds" in capsys.readouterr().err


# -- end to end on CPU ---------------------------------------------------------------------------


@pytest.mark.slow
def test_seeds_on_the_debug_model_in_two_parts_merged(tmp_path, monkeypatch, capsys):
    """bf16 at two seeds and tensorwise at one, as two invocations merged: the fewest runs that give a band
    and a paired gap."""
    monkeypatch.chdir(ROOT)
    train = ["--", "--training.batch_size", "2", "--training.seq_len", "64", "--validation.enable", "true",
             "--validation.path", "data/heldout", "--validation.freq", "3", "--validation.steps", "1"]
    for precision, seeds in (("bf16", "42,43"), ("tensorwise", "42")):
        rc = lc.main(["--config", "configs/debug.toml", "--steps", "6", "--precisions", precision, "--seeds", seeds,
                      "--compile", "none", "--out", str(tmp_path / precision), *train])
        assert rc == 0, capsys.readouterr().out
    out = tmp_path / "loss"
    assert lc.main(["--merge", str(tmp_path / "bf16"), str(tmp_path / "tensorwise"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "loss_compare.json").read_text())
    assert report["failures"] == {} and report["environment"]["torch"] and report["window"] == 1
    assert [r["name"] for r in report["runs"]] == ["bf16-none-seed42", "bf16-none-seed43", "tensorwise-none-seed42"]
    for run in report["runs"]:
        assert run["ok"] and len(run["train_loss"]) == 6 and run["train_steps"] == [1, 2, 3, 4, 5, 6]
        assert sorted(run["validation_loss"], key=int) == ["3", "6"]
        assert f"--training.seed {run['seed']}" in run["command"] and run["tps"] > 0
        run_dir = tmp_path / run["precision"] / "runs" / run["name"]
        assert "step" in (run_dir / "log.txt").read_text()
        events = list((tmp_path / run["precision"] / "tb" / run["name"]).glob("events.out.tfevents.*"))
        assert events and all(f".{socket.gethostname()}." not in e.name for e in events)
    bf16 = report["runs"][:2]
    assert bf16[0]["train_loss"][0] != bf16[1]["train_loss"][0]  # the seed changed the init
    # The band is the two bf16 runs' held-out spread; the gap pairs tensorwise with bf16 seed 42.
    held = [ls.heldout_tail(r) for r in report["runs"]]
    assert report["seeds"] == [42, 43] and report["noise_metric"] == "heldout"
    assert report["bf16_seed_spread_nats"] == pytest.approx(abs(held[0] - held[1]) / 2 ** 0.5)
    assert report["recipes"]["tensorwise"]["gap_nats"] == {"mean": pytest.approx(held[2] - held[0]), "spread": None}
    verdict = report["verdicts"]["tensorwise"]["text"]
    assert verdict.startswith(("tensorwise: within bf16's seed noise:", "tensorwise: better by ",
                               "tensorwise: worse by ")), verdict
    md = (out / "loss_compare.md").read_text()
    assert "## Against bf16's seed noise" in md and f"- {verdict}" in md
    assert printed.rstrip().splitlines()[-1].startswith("| tensorwise seed 42 |")  # the table comes last
    png = out / "loss_compare.png"
    assert png.exists() == bool(importlib.util.find_spec("matplotlib"))
    if png.exists():
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 5000
