"""Loss curves of the recipes against bf16: series, seed bands, report and chart (loss_compare.py)."""
