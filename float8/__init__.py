"""Float8 training for nn.Linear layers: dynamic tensorwise or rowwise scaling with torch._scaled_mm.

    report = convert_to_float8_training(model, config=Float8Config(scaling="tensorwise"))

Convert before tensor parallelism, torch.compile and FSDP2. With
`fsdp_float8_all_gather=True`, call `precompute_float8_scales_for_fsdp(model)` after
each optimizer step. Recipes are data (`float8.recipe.RECIPES`). Importing or using the
package changes no global torch setting; `raise_dynamo_recompile_limit` is for the caller
to apply. `float8.autofilter.AutoFilter` is a `module_filter_fn` that converts only the linears
whose float8 forward + backward timed faster than bf16's. See docs/float8.md.
"""

from float8.autofilter import AutoFilter, ShapeTiming, linear_shapes, time_linear_shapes
from float8.config import Float8Config
from float8.convert import Float8ConversionReport, KeepHighPrecision, convert_to_float8_training
from float8.fsdp import precompute_float8_scales_for_fsdp
from float8.linear import Float8Linear
from float8.recipe import RECIPES, Cast, Float8Recipe, Gemm
from float8.scaling import raise_dynamo_recompile_limit

__all__ = [
    "RECIPES",
    "AutoFilter",
    "Cast",
    "Float8Config",
    "Float8ConversionReport",
    "Float8Linear",
    "Float8Recipe",
    "Gemm",
    "KeepHighPrecision",
    "ShapeTiming",
    "convert_to_float8_training",
    "linear_shapes",
    "precompute_float8_scales_for_fsdp",
    "raise_dynamo_recompile_limit",
    "time_linear_shapes",
]
