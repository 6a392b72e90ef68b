"""The package's torch ops (float8/ops.py) dispatch straight to their kernel."""

import importlib
import importlib.util

import pytest
import torch

# Each module defines its ops on import; the Triton casts' only where Triton is there.
OPS = {"blockwise_scaled_mm": "float8.gemm"}
if importlib.util.find_spec("triton") is not None:
    OPS |= {"cast_rows": "float8.kernels.cast", "cast_blocks": "float8.kernels.blocks"}


@pytest.mark.parametrize("name", OPS)
def test_an_op_has_no_python_autograd_layer(name):
    """A torch.library.custom_op registers a Python Autograd kernel, a second trip into Python
    on every call (~35 us of host time on an H100 machine, hundreds of calls a rowwise step)."""
    importlib.import_module(OPS[name])
    qualified = f"float8_training::{name}"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeExplicitAutograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Autograd")
