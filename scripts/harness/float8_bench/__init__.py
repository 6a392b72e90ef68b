"""The float8 implementations a benchmark compares and the benchmark's report (bench_float8.py)."""
