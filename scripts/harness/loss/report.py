"""The numbers of scripts/loss_compare.py and its loss_compare.md / loss_compare.json.

A run is a dict (as loss_compare.json keeps it): precision, compile, seed (None: the config's),
ok, reason, command, log, tps, warmup, and its series: train_steps / train_loss (every logged
step) and validation_loss ({"step": loss}). `build_report` adds each run's stats (gaps to the bf16
run of the same seed, by step) and the verdicts; it is what a merge calls again on the runs of
several parts, so nothing is trusted from them. Gaps are signed, relative to bf16, in %: positive
when float8's loss is higher (worse).

With seeds, the verdicts weigh each recipe's gap against bf16's own seed noise (seeds.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.harness.arguments import load_json_file
from scripts.harness.cells import BASELINE, PRECISIONS
from scripts.harness.compare.report import format_number
from scripts.harness.loss.seeds import render_seeds, seed_summary, seed_verdict
from scripts.harness.loss.series import (
    baseline_of,
    moving_average,
    relative_gap_pct,
    run_label,
    tail_mean,
    tail_steps,
    validation_of,
    worst_window_gap,
)

KIND = "loss_compare"
DEFAULT_TOLERANCE_PCT = 0.5
MAX_VALIDATION_COLUMNS = 4  # more evaluations than this: the table shows the last one only
HEALTH_OPERANDS = ("input", "weight", "grad_output")
HEALTH_PREFIX = "float8/worst/"
HEALTH_SHARES = ("underflow", "underflow_norm_share", "saturation", "saturation_norm_share")


class PartError(Exception):
    """A loss_compare.json that is missing, unreadable or not one."""


def health_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """float8/worst/<operand>/<quantity>[/layer] of the last record that has any: {"step", "operands":
    {operand: {quantity: {"value", "layer"}}}}; None without such keys. Odd keys and values are skipped."""
    for record in sorted(records, key=lambda r: r.get("step") or 0, reverse=True):
        operands: dict[str, dict[str, dict[str, Any]]] = {}
        for key, value in record.items():
            if not key.startswith(HEALTH_PREFIX):
                continue
            parts = key[len(HEALTH_PREFIX):].split("/")
            if len(parts) == 2 and isinstance(value, (int, float)) and not isinstance(value, bool):
                operands.setdefault(parts[0], {}).setdefault(parts[1], {})["value"] = float(value)
            elif len(parts) == 3 and parts[2] == "layer" and isinstance(value, str):
                operands.setdefault(parts[0], {}).setdefault(parts[1], {})["layer"] = value
        operands = {op: {q: v for q, v in qs.items() if "value" in v} for op, qs in operands.items()}
        operands = {op: qs for op, qs in operands.items() if qs}
        if operands:
            return {"step": record.get("step"), "operands": operands}
    return None


def run_stats(run: dict[str, Any], base: dict[str, Any] | None, steps: int, window: int) -> dict[str, Any]:
    """Final training loss, held-out losses and their gaps to `base` (the ok bf16 run, or None)."""
    train = tail_mean(run["train_steps"], run["train_loss"], steps)
    val = validation_of(run)
    stats: dict[str, Any] = {"train_loss_tail": train, "train_gap_pct": None, "worst_window_gap_pct": None,
                             "worst_window_step": None, "validation_gap_pct": {}}
    last = max(val, default=None)
    stats["final_validation_step"] = last
    stats["final_validation_loss"] = val.get(last) if last is not None else None
    stats["final_validation_gap_pct"] = None
    if base is None or run is base:
        return stats
    stats["train_gap_pct"] = relative_gap_pct(train, tail_mean(base["train_steps"], base["train_loss"], steps))
    worst = worst_window_gap(moving_average(base["train_steps"], base["train_loss"], window),
                             moving_average(run["train_steps"], run["train_loss"], window))
    if worst is not None:
        stats["worst_window_gap_pct"], stats["worst_window_step"] = worst
    base_val = validation_of(base)
    stats["validation_gap_pct"] = {str(s): relative_gap_pct(x, base_val.get(s)) for s, x in sorted(val.items())}
    if last is not None:
        stats["final_validation_gap_pct"] = relative_gap_pct(val[last], base_val.get(last))
    return stats


def gap_text(gap: float | None) -> str:
    return "n/a" if gap is None else f"{gap:+.2f} %"


def verdict(precision: str, stats: dict[str, Any], tolerance: float) -> tuple[bool | None, str]:
    """(within, line): within ±tolerance % of bf16 on the final training and held-out loss, or which is not."""
    train, val = stats["train_gap_pct"], stats["final_validation_gap_pct"]
    if train is None:
        return None, f"{precision}: no verdict: no final training loss to compare"
    checks = [("final training loss", train, "")]
    if val is not None:
        checks.append(("final held-out loss", val, f" at step {stats['final_validation_step']}"))
    within = all(abs(g) <= tolerance for _, g, _ in checks)
    if within:
        text = f"within ±{tolerance:g} % of bf16: " + ", ".join(f"{n} {gap_text(g)}{at}" for n, g, at in checks)
    else:
        text = f"NOT within ±{tolerance:g} % of bf16: " + ", ".join(
            f"{n} {gap_text(g)}{at} ({'within' if abs(g) <= tolerance else 'outside'})" for n, g, at in checks)
    if val is None:
        text += "; no held-out loss to compare (validation off, or not evaluated in both runs)"
    return within, f"{precision}: {text}"


def build_report(info: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """loss_compare.json: info, the runs (in PRECISIONS order, then by seed) with their stats, the seed
    comparison when the runs have seeds, verdicts and failures."""
    runs = sorted(runs, key=lambda r: (PRECISIONS.index(r["precision"]), r.get("seed") or 0))
    summary = seed_summary(runs, info["steps"])
    verdicts = {}
    for run in runs:
        base = baseline_of(runs, run.get("seed"))
        run["stats"] = run_stats(run, base, info["steps"], info["window"]) if run["ok"] else None
        if run["precision"] == BASELINE or summary["seeds"]:
            continue
        if base is None:
            verdicts[run["precision"]] = {"within": None, "text": f"{run['precision']}: no verdict: bf16 is missing"}
        elif not run["ok"]:
            verdicts[run["precision"]] = {"within": None, "text": f"{run['precision']}: no verdict: the run failed"}
        else:
            within, text = verdict(run["precision"], run["stats"], info["tolerance"])
            verdicts[run["precision"]] = {"within": within, "text": text}
    if summary["seeds"]:
        bands = summary["bf16_seed_spread_by_metric_nats"]
        verdicts = {p: seed_verdict(p, recipe, bands) for p, recipe in summary["recipes"].items()}
    return {"kind": KIND, **info, "baseline": BASELINE, **summary, "runs": runs, "verdicts": verdicts,
            "failures": {r["name"]: r["reason"] for r in runs if not r["ok"]}}


def validation_columns(report: dict[str, Any]) -> tuple[list[int], int]:
    """(the evaluated steps the table shows, how many there were): all of a few, else the last."""
    evaluated = sorted({s for r in report["runs"] if r["ok"] for s in validation_of(r)})
    return (evaluated if len(evaluated) <= MAX_VALIDATION_COLUMNS else evaluated[-1:]), len(evaluated)


def render_table(report: dict[str, Any]) -> str:
    """One row per run: final training loss and gap, worst moving-window gap, held-out losses, tokens/s."""
    shown, evaluated = validation_columns(report)
    last_of = f" (last of {evaluated})" if len(shown) < evaluated else ""
    header = (["precision", f"train loss (last {tail_steps(report['steps'])} steps)", "vs bf16",
               f"worst gap (window {report['window']})"]
              + [f"held-out @ {s}" + (last_of if s == shown[-1] else "") for s in shown] + ["tokens/s/GPU"])
    rows = ["| " + " | ".join(header) + " |", "|---|" + "--:|" * (len(header) - 1)]
    for r in report["runs"]:
        if not r["ok"]:
            rows.append(f"| {run_label(r)} | failed |" + " |" * (len(header) - 2))
            continue
        base = baseline_of(report["runs"], r.get("seed"))
        st, is_base = r["stats"], r is base
        val, val_gaps = validation_of(r), st["validation_gap_pct"]
        worst = ("-" if is_base else "n/a" if st["worst_window_step"] is None
                 else f"{gap_text(st['worst_window_gap_pct'])} @ step {st['worst_window_step']}")
        cells = [run_label(r), "n/a" if st["train_loss_tail"] is None else f"{st['train_loss_tail']:.4f}",
                 "baseline" if is_base else gap_text(st["train_gap_pct"]), worst]
        for s in shown:
            text = f"{val[s]:.4f}" if s in val else "-"
            if s in val and not is_base and base is not None:
                text += f" ({gap_text(val_gaps.get(str(s)))})"
            cells.append(text)
        tps = "n/a" if r.get("tps") is None else f"{r['tps']:,.0f}"
        if r.get("tps") and base is not None and not is_base and base.get("tps"):
            tps += f" ({r['tps'] / base['tps']:.2f}x)"
        rows.append("| " + " | ".join([*cells, tps]) + " |")
    return "\n".join(rows)


def render_health(report: dict[str, Any]) -> str:
    """Worst underflow and saturation per operand, and the largest amax growth, per float8 run; "" if none."""
    runs = [r for r in report["runs"] if r.get("health") and r["precision"] != BASELINE]
    if not runs:
        return ""
    lines = ["## Float8 health", "",
             "From the last record of each run with `float8/worst/...` keys: per operand, the layer with the "
             "largest share of its non-zero values that underflow to zero or saturate at the float8 maximum "
             "(count), and the layer with the largest share of its squared L2 norm those values held (norm "
             "share: the harm; under ~1e-3, float8's own rounding error, it costs nothing).", "",
             "| recipe | step | operand | underflow (count) | layer | underflow (norm share) | layer "
             "| saturation (count) | layer | saturation (norm share) | layer |",
             "|---|--:|---|--:|---|--:|---|--:|---|--:|---|"]
    growth = []
    for r in runs:
        ops = r["health"]["operands"]
        order = [op for op in HEALTH_OPERANDS if op in ops] + sorted(set(ops) - set(HEALTH_OPERANDS))
        for op in order:
            if not any(q in ops[op] for q in HEALTH_SHARES):
                continue
            cells = []
            for q in HEALTH_SHARES:
                entry = ops[op].get(q)
                shown = None if entry is None else (f"{entry['value']:.2g}" if q.endswith("_norm_share")
                                                    else f"{100 * entry['value']:.3g} %")
                cells += ["-", "-"] if entry is None else [shown, entry.get("layer", "?")]
            lines.append(f"| {run_label(r)} | {r['health']['step']} | {op} | " + " | ".join(cells) + " |")
        amax = [(ops[op]["amax_growth"]["value"], op, ops[op]["amax_growth"].get("layer", "?"))
                for op in order if "amax_growth" in ops[op]]
        if amax:
            value, op, layer = max(amax, key=lambda t: t[0])
            growth.append(f"{run_label(r)}: {format_number(value)} ({op}, {layer})")
    if growth:
        lines += ["", "Largest amax growth: " + "; ".join(growth) + "."]
    return "\n".join(lines)


def _device(env: dict[str, Any]) -> str:
    return env.get("gpu") or f"CPU ({env.get('cpu', '?')})"


def render_markdown(report: dict[str, Any]) -> str:
    env, steps = report["environment"], report["steps"]
    has_base = any(r["precision"] == BASELINE and r["ok"] for r in report["runs"])
    parts = ["# Is float8 hurting my loss? bf16 vs float8, same config, seed and data", "",
             render_table(report), ""]
    if seeds := render_seeds(report):
        parts += [seeds, ""]
    if not has_base:
        parts += ["bf16 is missing (not among these runs, or it failed): no gaps to compare. Run it with "
                  "`--precisions bf16` and combine the parts with `--merge`.", ""]
    if report["verdicts"]:
        parts += ["Verdicts:", ""] + [f"- {v['text']}" for v in report["verdicts"].values()] + [""]
    if report["failures"]:
        parts += ["Failed runs:", ""] + [f"- {r['name']}: {r['reason']} (log: {r['log']})"
                                         for r in report["runs"] if not r["ok"]] + [""]
    warmups = sorted({r.get("warmup") for r in report["runs"] if r.get("warmup") is not None})
    parts += [
        f"train loss: mean training loss over the last {tail_steps(steps)} of {steps} steps; vs bf16: its "
        "gap to bf16's (of the same seed), signed (positive: float8's loss is higher). worst gap: the largest gap, signed, "
        f"between the two runs' moving averages of the training loss over {report['window']} steps, and "
        "the step that ends that window. held-out @ N: the validation loss at step N (gap to bf16 in "
        f"brackets). tokens/s/GPU: median after the {'/'.join(map(str, warmups)) or '?'} warm-up steps "
        f"(vs bf16 in brackets). " + (
            "Verdicts weigh the mean held-out gap (the training one without evaluations) against bf16's seed "
            "spread of the same loss." if report.get("seeds") else
            f"Verdicts use ±{report['tolerance']:g} % on the final training loss and the last held-out loss; "
            "one seed cannot tell a gap from bf16's own seed noise: use --seeds 42,43,44.") + ("" if env.get("gpu") else " On a CPU without native bf16 the bf16 run "
                                     "computes in float32 (training.mixed_precision_param = auto)."), ""]
    if health := render_health(report):
        parts += [health, ""]
    overrides = " ".join(report.get("train_overrides") or []) or "none"
    parts += [
        f"- command: `{report['command']}`",
        f"- date: {report['date']}",
        f"- torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
        + f", python {env['python']}",
        f"- device: {_device(env)} x {report['nproc']} process(es)",
        f"- config: {report['config']}, {steps} steps, compile {report['compile']}, overrides: {overrides}",
    ]
    for p in report.get("parts") or []:
        penv = p["environment"]
        parts.append(f"- part {p['path']} ({', '.join(p['precisions'])}): `{p['command']}`, {p['date']}, "
                     f"torch {penv['torch']}, {_device(penv)}")
    return "\n".join(parts) + "\n"


_RUN_KEYS = {"precision": str, "ok": bool, "train_steps": list, "train_loss": list, "validation_loss": dict}
_INFO_KEYS = ("config", "steps", "compile", "nproc", "train_overrides", "environment", "command", "date")


def load_part(path: Path) -> dict[str, Any]:
    """A loss_compare.json written by build_report; raises PartError with a one-line reason."""
    data = load_json_file(path, PartError)
    runs = data.get("runs") if isinstance(data, dict) else None
    if (data.get("kind") if isinstance(data, dict) else None) != KIND or not isinstance(runs, list) or not all(
        isinstance(r, dict) and all(isinstance(r.get(k), t) for k, t in _RUN_KEYS.items())
        and r["precision"] in PRECISIONS for r in runs
    ) or any(k not in data for k in _INFO_KEYS):
        raise PartError(f"{path}: not a loss_compare.json (kind {KIND}, runs with their loss series)")
    return data
