"""The trainer's one seam to float8: one module per implementation (ours.py: float8/, reference.py: torchao.float8)."""
