"""Float8 training for nn.Linear layers: dynamic tensorwise or rowwise scaling with torch._scaled_mm.

    report = convert_to_float8_training(model, config=Float8Config(scaling="tensorwise"))

Convert before tensor parallelism, torch.compile and FSDP2. With
`fsdp_float8_all_gather=True`, call `precompute_float8_scales_for_fsdp(model)` after
each optimizer step. See docs/float8.md.
"""

from float8.config import Float8Config
from float8.convert import Float8ConversionReport, convert_to_float8_training
from float8.fsdp import precompute_float8_scales_for_fsdp
from float8.linear import Float8Linear

__all__ = [
    "Float8Config",
    "Float8ConversionReport",
    "Float8Linear",
    "convert_to_float8_training",
    "precompute_float8_scales_for_fsdp",
]
