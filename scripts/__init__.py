"""The commands a user runs (one module each, with --help), and the packages they share:
harness/ (train.py runs, their metrics and traces, the reports) and corpus/ (corpus building)."""
