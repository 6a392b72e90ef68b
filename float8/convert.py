"""Swap eligible nn.Linear modules for Float8Linear, in place, and report what happened."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from float8.config import Float8Config
from float8.linear import Float8Linear

# The rules that keep a linear in high precision, as `Float8ConversionReport.kept_by` names them
# (a `KeepHighPrecision` may name its own, as filter = "auto"'s AutoFilter does).
FILTER_FQNS, ALIGNMENT, MIN_FEATURES, MODULE_FILTER = "filter_fqns", "alignment", "min_features", "module_filter_fn"


@dataclass
class Float8ConversionReport:
    converted: list[str] = field(default_factory=list)
    # (fqn, why), the why as the summary prints it.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # fqn -> the rule that kept it in high precision, for code that acts on the why.
    kept_by: dict[str, str] = field(default_factory=dict)

    def skip(self, fqn: str, rule: str, reason: str) -> None:
        self.skipped.append((fqn, reason))
        self.kept_by[fqn] = rule

    def __str__(self) -> str:
        text = f"{len(self.converted)} converted"
        if self.converted:
            text += f" ({layer_names(self.converted)})"
        if self.skipped:
            text += f"; {len(self.skipped)} skipped: {_by_reason(self.skipped)}"
        return text


def layer_names(fqns: list[str]) -> str:
    """Layer names for a summary, repeated layers collapsed by leaf name: "wq, wk x32", or
    "output, w1 x4" when counts differ."""
    groups: dict[str, list[str]] = {}
    for fqn in fqns:
        groups.setdefault(fqn.rsplit(".", 1)[-1], []).append(fqn)
    counts = {len(g) for g in groups.values()}
    if len(counts) == 1 and (n := counts.pop()) > 1:
        return ", ".join(groups) + f" x{n}"
    return ", ".join(g[0] if len(g) == 1 else f"{leaf} x{len(g)}" for leaf, g in groups.items())


def _by_reason(items: list[tuple[str, str]]) -> str:
    by_reason: dict[str, list[str]] = {}
    for fqn, why in items:
        by_reason.setdefault(why, []).append(fqn)
    return "; ".join(layer_names(fqns) + (f" ({why})" if why else "") for why, fqns in by_reason.items())


@dataclass(frozen=True)
class KeepHighPrecision:
    """What a `module_filter_fn` may return instead of False: keep the linear, for `reason`
    (which the report lists) under `rule` (its `kept_by`). It is falsy, so filters that return
    it read as False anywhere."""

    reason: str
    rule: str = MODULE_FILTER

    def __bool__(self) -> bool:
        return False


ModuleFilterFn = Callable[[nn.Module, str], bool | KeepHighPrecision]


@dataclass(frozen=True)
class TensorParallelAlignment:
    """A `module_filter_fn` for linears that will run tensor parallel over `degree` ranks: each
    rank's GEMMs take 1/degree of one feature dim (colwise the out, rowwise the in), which must
    stay a multiple of `config`'s alignment (a blockwise rank's weight shard then holds whole
    128x128 blocks, the blocks of the full weight). Either dim may be split, so both must fit."""

    config: Float8Config
    degree: int

    def __call__(self, module: nn.Module, fqn: str) -> bool | KeepHighPrecision:
        align = self.config.recipe.feature_alignment
        for dim in ("in_features", "out_features"):
            size = getattr(module, dim)
            if size % (align * self.degree):
                return KeepHighPrecision(f"{dim} {size} / TP {self.degree} not divisible by {align}", rule=ALIGNMENT)
        return True


def all_of(*filters: ModuleFilterFn | None) -> ModuleFilterFn | None:
    """The `module_filter_fn` that converts what every given filter converts (the first refusal's
    reason is the report's); None when none is given."""
    given = [f for f in filters if f is not None]
    if len(given) < 2:
        return given[0] if given else None

    def verdict(module: nn.Module, fqn: str) -> bool | KeepHighPrecision:
        for f in given:
            if not (answer := f(module, fqn)):
                return answer
        return True

    return verdict


def rules_skip(fqn: str, linear: nn.Linear, config: Float8Config) -> tuple[str, str] | None:
    """(rule, why) `config`'s rules (filter_fqns, alignment, min_features) keep `linear` in high
    precision, or None when they convert it."""
    if any(f in fqn for f in config.filter_fqns):
        return FILTER_FQNS, "filtered by filter_fqns"
    # cuBLAS float8 GEMMs need both weight dims to be multiples of 16; block-scaled recipes of their tiles.
    align = config.recipe.feature_alignment
    for dim in ("in_features", "out_features"):
        size = getattr(linear, dim)
        if size % align:
            return ALIGNMENT, f"{dim} {size} not divisible by {align}"
    if min(linear.in_features, linear.out_features) < config.min_features:
        return MIN_FEATURES, "smaller than min_features"
    return None


def rules_skip_reason(fqn: str, linear: nn.Linear, config: Float8Config) -> str | None:
    """Why `config`'s rules keep `linear` in high precision, or None when they convert it."""
    skip = rules_skip(fqn, linear, config)
    return None if skip is None else skip[1]


def _skip(
    fqn: str, linear: nn.Linear, config: Float8Config, module_filter_fn: ModuleFilterFn | None
) -> tuple[str, str] | None:
    skip = rules_skip(fqn, linear, config)
    if skip is None and module_filter_fn is not None:
        verdict = module_filter_fn(linear, fqn)
        if isinstance(verdict, KeepHighPrecision):
            return verdict.rule, verdict.reason
        if not verdict:
            return MODULE_FILTER, "rejected by module_filter_fn"
    return skip


def convert_to_float8_training(
    model: nn.Module,
    config: Float8Config | None = None,
    module_filter_fn: ModuleFilterFn | None = None,
) -> Float8ConversionReport:
    """Replace eligible `nn.Linear`s in `model` by `Float8Linear`s sharing their parameters.

    Works on any device including `meta` (nothing is allocated or copied). Call it
    before tensor parallelism, compile and FSDP. `module_filter_fn(module, fqn)`, asked only
    about linears the rules convert, keeps that linear in high precision when it returns False
    or a `KeepHighPrecision(reason)` (the report then gives the reason).
    """
    config = config or Float8Config()
    if isinstance(model, nn.Linear):
        raise ValueError("convert_to_float8_training swaps submodules in place: pass the module that holds the linear")
    report = Float8ConversionReport()
    # A linear registered under several names stays one module (shared weights): it is
    # converted once, under its first name, and every name then points at the same copy.
    swapped: dict[int, Float8Linear] = {}
    for parent_fqn, parent in list(model.named_modules(remove_duplicate=False)):
        if isinstance(parent, Float8Linear):
            continue
        # _modules, not named_children(): the latter hides a second name of the same module.
        for name, child in list(parent._modules.items()):
            if not isinstance(child, nn.Linear) or isinstance(child, Float8Linear):
                continue
            if id(child) in swapped:
                setattr(parent, name, swapped[id(child)])
                continue
            fqn = f"{parent_fqn}.{name}" if parent_fqn else name
            skip = _skip(fqn, child, config, module_filter_fn)
            if skip is None:
                new = Float8Linear.from_float(child, config)
                setattr(parent, name, new)
                swapped[id(child)] = new
                report.converted.append(fqn)
            else:
                report.skip(fqn, *skip)
    return report
