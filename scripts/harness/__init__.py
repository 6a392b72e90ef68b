"""The experiment harness the measuring commands share: train.py runs as cells, their metrics and
traces read back, and the reports built on them (compare/, loss/, gpu_check/, float8_bench/)."""
