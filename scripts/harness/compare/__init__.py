"""One comparison cell run and its result, and the throughput report and chart (compare_throughput.py)."""
