"""Float8 training configuration."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from float8.operands import EAGER_CASTS
from float8.recipe import Float8Recipe, recipe_named


@dataclass(frozen=True)
class Float8Config:
    """How `convert_to_float8_training` converts linears and how they compute.

    Frozen: every converted linear holds the config it was converted with; a different one is
    a new object (`dataclasses.replace(config, emulate=True)`).

    scaling: the recipe, as a `Float8Recipe` object or the name of a built-in one
        (`float8.recipe.RECIPES`): "tensorwise" (one scale per tensor; e4m3 forward, e5m2
        gradients), "rowwise" (one power-of-two scale per row along each GEMM's contraction
        dim; all e4m3), "rowwise_gw_hp" (rowwise, but the weight gradient GEMM stays in high
        precision), "blockwise" (DeepSeek-V3's: power-of-two e4m3 scales per 1x128 tile of activations
        and gradients and per 128x128 block of the weight). torchao.float8's names for the first two (strings or its
        `Float8LinearRecipeName` members) are accepted too. docs/float8/library.md tabulates every cast.
        `recipe` is the resolved `Float8Recipe`.
    emulate: float8 rounding with high-precision GEMMs, for hardware without float8 GEMMs.
    fsdp_float8_all_gather: FSDP2 all-gathers weights as float8 (tensorwise, blockwise).
    fsdp_unshard_as_stored: FSDP2 over one rank hands each float8 linear its weight as stored (fp32)
        instead of a bf16 copy, which the casts round to bf16 as they read it (the same bytes); with
        an unshard that keeps its input (the trainer's one-GPU fast path) nothing is copied. For
        recipes that cast the weight per row in the step (rowwise, rowwise_gw_hp); FSDP2 over more
        ranks refuses it at the first unshard (it would all-gather fp32).
    filter_fqns: skip modules whose fully qualified name contains any of these strings; the
        output layer by default (its logits feed the softmax directly: float8 costs accuracy
        there and saves little).
    min_features: skip linears whose in_features or out_features is below this.
    eager_casts: how casts run outside torch.compile: "triton" (float8/kernels: one read writes
        both layouts, scale and inverse from the cast's own kernels; CUDA), "compiled" (each
        cast compiled into fused kernels by torch.compile), "plain" (eager PyTorch ops), or
        "auto": triton on CUDA where Triton imports, else compiled on CUDA, plain elsewhere.
        triton and plain give the same bytes (compiled: a scale can be 1 ulp off, from
        inductor's division). Under an outer torch.compile the casts are traced with the model,
        except block-scaled ones where this resolves to triton: those call the kernels as one op.
    dynamo_recompile_limit: the per-function recompile limit the "compiled" eager casts need
        (one variant per float8 dtype, input dtype and layout). Nothing in this package
        changes torch's global settings: `float8.raise_dynamo_recompile_limit(limit)` applies
        it process-wide (the trainer does); below it, rarer variants run unfused.
    """

    scaling: str | Float8Recipe = "tensorwise"
    emulate: bool = False
    fsdp_float8_all_gather: bool = False
    fsdp_unshard_as_stored: bool = False
    filter_fqns: tuple[str, ...] = ("output",)
    min_features: int = 0
    eager_casts: str = "auto"
    dynamo_recompile_limit: int = 64
    recipe: Float8Recipe = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # object.__setattr__: the frozen dataclass's own normalisation, before anyone holds it.
        if isinstance(self.scaling, enum.Enum):
            object.__setattr__(self, "scaling", self.scaling.value)
        if isinstance(self.scaling, Float8Recipe):
            recipe = self.scaling
        elif isinstance(self.scaling, str):
            try:
                recipe = recipe_named(self.scaling)
            except ValueError as e:
                raise ValueError(f"Float8Config.scaling: {e}") from None
        else:
            raise ValueError(f"Float8Config.scaling must be a recipe name or a Float8Recipe, got {self.scaling!r}")
        object.__setattr__(self, "recipe", recipe)
        for name in ("emulate", "fsdp_float8_all_gather", "fsdp_unshard_as_stored"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Float8Config.{name} must be a bool, got {getattr(self, name)!r}")
        if (
            isinstance(self.filter_fqns, str)
            or not isinstance(self.filter_fqns, (list, tuple))
            or not all(isinstance(s, str) for s in self.filter_fqns)
        ):
            raise ValueError(
                f"Float8Config.filter_fqns must be a list of strings, got {self.filter_fqns!r}"
            )
        object.__setattr__(self, "filter_fqns", tuple(self.filter_fqns))
        for name in ("min_features", "dynamo_recompile_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Float8Config.{name} must be an int >= 0, got {value!r}")
        if self.eager_casts not in EAGER_CASTS:
            raise ValueError(f"Float8Config.eager_casts must be one of {EAGER_CASTS}, got {self.eager_casts!r}")
        if self.fsdp_float8_all_gather and not recipe.weight_gatherable_in_float8:
            raise ValueError(
                "Float8Config.fsdp_float8_all_gather needs a recipe that casts the weight to e4m3 alike in both GEMMs "
                f"that read it, per tensor or in square blocks (scaling='tensorwise' or 'blockwise'), got scaling={recipe.name!r}"
            )
        if self.fsdp_unshard_as_stored and not recipe.weight_cast_per_row:
            raise ValueError(
                "Float8Config.fsdp_unshard_as_stored needs a recipe that casts the weight per row in both GEMMs that read it "
                f"(scaling='rowwise' or 'rowwise_gw_hp'), got scaling={recipe.name!r}"
            )
