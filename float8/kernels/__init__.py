"""Triton kernels for the float8 casts outside torch.compile (`Float8Config.eager_casts`).

Imported only where Triton is there (torch's CUDA builds bring it), by float8/operands.py;
`cast.py` holds the kernels and their launchers.
"""
