"""scripts/bench_float8.py's results: speedups over bf16, the targets they are held to, ours
against torchao, and the table printed last."""

from __future__ import annotations

TARGETS = {  # (section, variant, mode) -> minimum speedup over bf16 on an H200
    ("blocks", "compiled", "tensorwise"): 1.43,
    ("blocks", "compiled", "rowwise"): 1.25,
    ("blocks", "eager", "tensorwise"): 1.0,
}


def add_speedups(rows: list[dict]) -> None:
    """Each row's speedup: bf16's time for its section, shape and variant over its own (or None)."""
    base = {(r["section"], r["name"], r["variant"]): r["ms"] for r in rows if r["mode"] == "bf16"}
    for r in rows:
        ref = base.get((r["section"], r["name"], r["variant"]))
        r["speedup"] = ref / r["ms"] if ref else None


def target_checks(rows: list[dict]) -> list[str]:
    """One line per row held to a TARGETS speedup or to the blocks' peak-memory target."""
    checks = []
    for r in rows:
        target = TARGETS.get((r["section"], r["variant"], r["mode"]))
        if target and r["speedup"]:
            checks.append(f"{r['section']} {r['variant']} {r['mode']} ({r['impl']}): {r['speedup']:.2f}x bf16 "
                          f"(target >= {target:.2f}x)")
    bf16_peak = {r["variant"]: r["peak_gib"] for r in rows if r["section"] == "blocks" and r["mode"] == "bf16"}
    for r in rows:
        ref = bf16_peak.get(r["variant"])
        if r["section"] == "blocks" and r["mode"] != "bf16" and r["peak_gib"] and ref:
            checks.append(f"blocks {r['variant']} {r['mode']} ({r['impl']}) peak memory: "
                          f"{r['peak_gib'] / ref:.2f}x bf16 (target <= 0.85x)")
    return checks


def side_by_side(rows: list[dict]) -> list[str]:
    """Ours against torchao for every cell both ran: the time ratio, > 1 when ours is faster."""
    torchao = {(r["section"], r["name"], r["variant"], r["mode"]): r for r in rows if r["impl"] == "torchao"}
    lines = []
    for r in rows:
        ref = torchao.get((r["section"], r["name"], r["variant"], r["mode"]))
        if r["impl"] == "ours" and ref:
            lines.append(f"{r['section']} {r['name']} {r['variant']} {r['mode']}: ours {r['ms']:.2f} ms, "
                         f"torchao {ref['ms']:.2f} ms: ours {ref['ms'] / r['ms']:.2f}x torchao's speed")
    return lines


def print_table(rows: list[dict]) -> None:
    """Every row: time, TFLOP/s, tokens/s, speedup over bf16 and peak memory."""
    header = (
        f"{'section':8} {'shape':32} {'mode':14} {'impl':8} {'variant':9} {'ms':>9} {'TFLOP/s':>8} "
        f"{'tokens/s':>11} {'vs bf16':>8} {'peak GiB':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(
            f"{r['section']:8} {r['name']:32} {r['mode']:14} {r['impl']:8} {r['variant']:9} {r['ms']:9.2f} "
            f"{r['tflops']:8.1f} {r['tokens_per_s']:11.0f} {speedup:>8} {peak:>9}"
        )


def print_report(rows: list[dict], failures: list[str]) -> None:
    """Profiles, target checks, ours vs torchao and failed cells, then the table (last on stdout)."""
    for r in rows:
        if "profile" in r:
            cats = "  ".join(f"{k} {v:.2f}" for k, v in r["profile"].items())
            print(f"profile, one compiled blocks step, {r['mode']:14} {r['impl']:8} (ms): {cats}")
    for line in [*target_checks(rows), *side_by_side(rows)]:
        print(line)
    for line in failures:
        print(f"FAILED {line}")
    print()
    print_table(rows)

