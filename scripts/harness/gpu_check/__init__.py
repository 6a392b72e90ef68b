"""The GPU checklist's runs, verdicts and report (gpu_check.py)."""
