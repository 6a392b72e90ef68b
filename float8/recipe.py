"""Float8 training recipes as data: how each operand of a linear's three GEMMs is cast.

A linear ``out = x @ w.T`` (x: tokens x in, w: out x in) runs three GEMMs, each
``lhs @ rhs`` summing over one named axis::

    GEMM          computes                         lhs         rhs     sums over
    output        out         = x @ w.T            x           w.T     "in"
    grad_input    grad_x      = grad_out @ w       grad_out    w       "out"
    grad_weight   grad_w      = grad_out.T @ x     grad_out.T  x       "tokens"

A recipe gives each of the six operands a `Cast`; `float8/linear.py` interprets it. The
built-in recipes are `RECIPES` (read-only); a new one is a `Float8Recipe` object passed as
`Float8Config(scaling=my_recipe)`, no table to edit. `recipe_named` also takes torchao.float8's
recipe names (strings or its `Float8LinearRecipeName` members).
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from float8.scaling import E4M3, E5M2


@dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast.

    dtype: the float8 dtype (E4M3, E5M2), or None: the operand stays in high precision.
    amax_over: None for one scale per tensor; else one scale per row, from the amax over
        this axis, which must be the axis its GEMM sums over (only there does a row's
        scale factor out of the sum).
    pow2: scales rounded down to a power of two (exact scaling; only float8 rounding loses bits).
    block: None for the scales `amax_over` says; else one scale per tile of (rows, summed) values
        of the operand as its GEMM reads it (rows of the kept dim, then along `amax_over`, the
        summed axis): (1, 128) for DeepSeek-V3's activation tiles, (128, 128) for its weight
        blocks. A square block covers the same values of a tensor and of its transpose.
    """

    dtype: torch.dtype | None
    amax_over: str | None = None
    pow2: bool = False
    block: tuple[int, int] | None = None

    @property
    def square_blocks(self) -> bool:
        return self.block is not None and self.block[0] == self.block[1]


HIGH_PRECISION = Cast(None)


@dataclass(frozen=True)
class Gemm:
    """The casts of a GEMM's two operands, and whether cuBLAS may accumulate in lower precision."""

    lhs: Cast
    rhs: Cast
    fast_accum: bool = False

    @property
    def float8(self) -> bool:
        return self.lhs.dtype is not None

    @property
    def blockwise(self) -> bool:
        """Per-tile scales (both operands: the recipe checks it): the GEMM needs a block-scaled kernel."""
        return self.float8 and self.lhs.block is not None

    @property
    def rowwise(self) -> bool:
        """Per-row scales on either operand: the GEMM needs the row-wise scaled kernel."""
        return self.float8 and not self.blockwise and (self.lhs.amax_over is not None or self.rhs.amax_over is not None)


@dataclass(frozen=True)
class Float8Recipe:
    """The casts of the output, grad_input and grad_weight GEMMs of a float8 linear.

    name: what reports and `repr` call it; two recipes with the same casts are equal whatever their names.
    """

    output: Gemm
    grad_input: Gemm
    grad_weight: Gemm
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for name, axis in (("output", "in"), ("grad_input", "out"), ("grad_weight", "tokens")):
            gemm: Gemm = getattr(self, name)
            if (gemm.lhs.dtype is None) != (gemm.rhs.dtype is None):
                raise ValueError(f"{name}: both operands float8 or both high precision (no mixed GEMM kernels)")
            for side in ("lhs", "rhs"):
                over = getattr(gemm, side).amax_over
                if over is not None and over != axis:
                    raise ValueError(f"{name}.{side}: per-row scales must be over {axis!r}, the axis it sums over, got {over!r}")
            _check_blocks(name, gemm, axis)

    @property
    def rowwise_gemms(self) -> bool:
        """Whether any GEMM needs the row-wise scaled float8 kernel."""
        return self.output.rowwise or self.grad_input.rowwise or self.grad_weight.rowwise

    @property
    def feature_alignment(self) -> int:
        """What both of a linear's features must be multiples of: 16 for cuBLAS float8 GEMMs, or
        the longest tile that spans them (no tile of a weight or activation cut short)."""
        casts = (self.output.lhs, self.output.rhs, self.grad_input.lhs, self.grad_input.rhs)
        return max([16, *(n for c in casts if c.block is not None for n in c.block)])

    @property
    def blockwise_gemms(self) -> bool:
        """Whether any GEMM needs the block-scaled float8 kernel."""
        return self.output.blockwise or self.grad_input.blockwise or self.grad_weight.blockwise

    @property
    def weight_blocks(self) -> tuple[int, int] | None:
        """The square block both GEMMs that read the weight scale it by, when they cast it alike
        (e4m3, the same blocks and rounding): then one cast serves both, and each FSDP shard that
        holds whole blocks casts its own (float8/fsdp.py)."""
        fwd, bwd = self.output.rhs, self.grad_input.rhs
        same = fwd.square_blocks and fwd.dtype == E4M3 and fwd == dataclasses.replace(bwd, amax_over=fwd.amax_over)
        return fwd.block if same else None

    @property
    def weight_gatherable_in_float8(self) -> bool:
        """Both GEMMs that read the weight take it as FSDP's float8 all-gather makes it
        (float8/fsdp.py): e4m3, one scale per tensor, not rounded to a power of two; or e4m3
        in the same square blocks (`weight_blocks`)."""
        return self.output.rhs == self.grad_input.rhs == Cast(E4M3) or self.weight_blocks is not None

    @property
    def weight_cast_per_row(self) -> bool:
        """Both GEMMs that read the weight cast it with a scale per row (no blocks): the casts can read it
        as stored, fp32 standing for its bf16 copy (`Float8Config.fsdp_unshard_as_stored`)."""
        return all(c.dtype is not None and c.amax_over is not None and c.block is None
                   for c in (self.output.rhs, self.grad_input.rhs))

    @property
    def activations_gatherable_in_float8(self) -> bool:
        """The float8 TP styles (float8/tp.py) gather activations as e4m3 and gradients as e5m2
        with one scale per tensor; only casts that are the same reproduce the gathered values."""
        return (
            self.output.lhs == self.grad_weight.rhs == Cast(E4M3)
            and self.grad_input.lhs == self.grad_weight.lhs == Cast(E5M2)
        )


def _check_blocks(name: str, gemm: Gemm, axis: str) -> None:
    """Tiles tile the summed axis on both operands alike, or on neither: a block-scaled kernel
    takes no per-tensor or per-row scale beside a per-tile one."""
    lhs, rhs = gemm.lhs.block, gemm.rhs.block
    if (lhs is None) != (rhs is None):
        raise ValueError(f"{name}: both operands per tile or neither (no mixed block-scaled GEMM kernels)")
    if lhs is None or rhs is None:
        return
    for side, block in (("lhs", lhs), ("rhs", rhs)):
        if getattr(gemm, side).amax_over != axis or len(block) != 2 or min(block) < 1:
            raise ValueError(f"{name}.{side}: tiles must be (rows, summed) >= 1 along {axis!r}, the axis it sums over")
    if lhs[1] != rhs[1]:
        raise ValueError(f"{name}: both operands' tiles must have one length along {axis!r}, got {lhs[1]} and {rhs[1]}")


def _rows(dtype: torch.dtype, over: str) -> Cast:
    return Cast(dtype, amax_over=over, pow2=True)


def _tiles(over: str, rows: int = 1) -> Cast:
    """e4m3 with a power-of-two scale per (rows x 128) tile along `over` (DeepSeek-V3)."""
    return Cast(E4M3, amax_over=over, pow2=True, block=(rows, 128))


_BUILT_IN = (
    # One scale per tensor: the cheapest casts; e5m2 keeps the gradients' range.
    Float8Recipe(
        output=Gemm(Cast(E4M3), Cast(E4M3), fast_accum=True),
        grad_input=Gemm(Cast(E5M2), Cast(E4M3)),
        grad_weight=Gemm(Cast(E5M2), Cast(E4M3)),
        name="tensorwise",
    ),
    # One power-of-two scale per row along each GEMM's summed axis, all e4m3: robust to outliers.
    Float8Recipe(
        output=Gemm(_rows(E4M3, "in"), _rows(E4M3, "in"), fast_accum=True),
        grad_input=Gemm(_rows(E4M3, "out"), _rows(E4M3, "out")),
        grad_weight=Gemm(_rows(E4M3, "tokens"), _rows(E4M3, "tokens")),
        name="rowwise",
    ),
    # rowwise, with the weight gradient in high precision.
    Float8Recipe(
        output=Gemm(_rows(E4M3, "in"), _rows(E4M3, "in"), fast_accum=True),
        grad_input=Gemm(_rows(E4M3, "out"), _rows(E4M3, "out")),
        grad_weight=Gemm(HIGH_PRECISION, HIGH_PRECISION),
        name="rowwise_gw_hp",
    ),
    # DeepSeek-V3's: 1x128 tiles of activations and gradients, 128x128 blocks of the weight (one
    # cast serves both its GEMMs), grad_weight 1x128 x 1x128 along tokens; all e4m3, no fast accum.
    Float8Recipe(
        output=Gemm(_tiles("in"), _tiles("in", rows=128)),
        grad_input=Gemm(_tiles("out"), _tiles("out", rows=128)),
        grad_weight=Gemm(_tiles("tokens"), _tiles("tokens")),
        name="blockwise",
    ),
)
RECIPES: Mapping[str, Float8Recipe] = types.MappingProxyType({r.name: r for r in _BUILT_IN})

# torchao.float8's recipe names (Float8LinearRecipeName values) that are not ours. Its
# "tensorwise" and "rowwise" are ours under the same names. Its "rowwise_with_gw_hp" casts
# grad_input's weight with one scale per tensor where our rowwise_gw_hp has one per row.
_TORCHAO_ONLY = {
    "rowwise_with_gw_hp": "torchao's rowwise_with_gw_hp is not a recipe of this package (our rowwise_gw_hp "
    "casts grad_input's weight per row, torchao's per tensor): pass 'rowwise_gw_hp', or build torchao's "
    "casts as a Float8Recipe (docs/float8/library.md)",
}


def recipe_named(name: str | enum.Enum) -> Float8Recipe:
    """The built-in recipe called `name`: ours, or torchao's name (or Float8LinearRecipeName member) for it."""
    if isinstance(name, enum.Enum):
        name = name.value
    if name in RECIPES:
        return RECIPES[name]
    if name in _TORCHAO_ONLY:
        raise ValueError(_TORCHAO_ONLY[name])
    raise ValueError(f"no float8 recipe named {name!r}: one of {', '.join(RECIPES)}, or a Float8Recipe")
