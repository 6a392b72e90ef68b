"""Float8 training for nn.Linear layers: dynamic tensorwise, rowwise or blockwise (DeepSeek-V3) scaling.

    report = convert_to_float8_training(model, config=Float8Config(scaling="tensorwise"))

Convert before tensor parallelism, torch.compile and FSDP2. With
`fsdp_float8_all_gather=True`, call `precompute_float8_scales_for_fsdp(model)` after
each optimizer step, and with blockwise pass `fully_shard(..., shard_placement_fn=
fsdp_shard_placement(ranks))`. A recipe is a `Float8Recipe` object (`RECIPES` holds the built-in ones,
read-only; torchao.float8's names are accepted for them) passed as `Float8Config(scaling=...)`;
`Float8Config` is frozen. Importing or using the package changes no global torch setting;
`raise_dynamo_recompile_limit` is for the caller to apply. `AutoFilter` is a
`module_filter_fn` that converts only the linears whose float8 forward + backward timed faster
than bf16's. float8/examples/train_loop.py is a whole training loop with it; docs/float8/library.md
documents the package on its own.

The public API is `__all__` below, plus `float8.health` (per-cast statistics of the float8
linears during training). Every other module (scaling, operands, gemm, linear's autograd
function, fsdp's tensor subclasses, kernels) is internal and may change without notice.
"""

from float8.autofilter import AutoFilter, ShapeTiming, linear_shapes, time_linear_shapes
from float8.config import Float8Config
from float8.convert import Float8ConversionReport, KeepHighPrecision, convert_to_float8_training
from float8.fsdp import precompute_float8_scales_for_fsdp
from float8.fsdp_blocks import fsdp_shard_placement
from float8.gemm import scaled_mm_supported
from float8.linear import Float8Linear
from float8.recipe import HIGH_PRECISION, RECIPES, Cast, Float8Recipe, Gemm, recipe_named
from float8.scaling import E4M3, E5M2, raise_dynamo_recompile_limit
from float8.tp import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput

__all__ = [
    "E4M3",
    "E5M2",
    "HIGH_PRECISION",
    "RECIPES",
    "AutoFilter",
    "Cast",
    "Float8ColwiseParallel",
    "Float8Config",
    "Float8ConversionReport",
    "Float8Linear",
    "Float8Recipe",
    "Float8RowwiseParallel",
    "Gemm",
    "KeepHighPrecision",
    "PrepareFloat8ModuleInput",
    "ShapeTiming",
    "convert_to_float8_training",
    "fsdp_shard_placement",
    "linear_shapes",
    "precompute_float8_scales_for_fsdp",
    "raise_dynamo_recompile_limit",
    "recipe_named",
    "scaled_mm_supported",
    "time_linear_shapes",
]
