"""The float8 benchmarks' parts: the implementations compared, the step timer and the report
(bench_float8.py, bench_float8_casts.py: its AdamW and host-time sections in adamw.py and host.py)."""
