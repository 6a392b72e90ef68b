"""Float8 training configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

SCALINGS = ("tensorwise", "rowwise", "rowwise_gw_hp")


@dataclass
class Float8Config:
    """How `convert_to_float8_training` converts linears and how they compute.

    scaling: "tensorwise" (one scale per tensor; e4m3 forward, e5m2 gradients),
        "rowwise" (one power-of-two scale per row along each GEMM's contraction dim; all e4m3),
        "rowwise_gw_hp" (rowwise, but the weight gradient GEMM stays in high precision).
    emulate: float8 rounding with high-precision GEMMs, for hardware without float8 GEMMs.
    fsdp_float8_all_gather: FSDP2 all-gathers weights as float8 (tensorwise only).
    filter_fqns: skip modules whose fully qualified name contains any of these strings.
    min_features: skip linears whose in_features or out_features is below this.
    """

    scaling: str = "tensorwise"
    emulate: bool = False
    fsdp_float8_all_gather: bool = False
    filter_fqns: list[str] = field(default_factory=list)
    min_features: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"Float8Config.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        for name in ("emulate", "fsdp_float8_all_gather"):
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
        self.filter_fqns = list(self.filter_fqns)
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int) or self.min_features < 0:
            raise ValueError(
                f"Float8Config.min_features must be an int >= 0, got {self.min_features!r}"
            )
        if self.fsdp_float8_all_gather and self.scaling != "tensorwise":
            raise ValueError(
                "Float8Config.fsdp_float8_all_gather needs scaling='tensorwise' (one scale per weight "
                f"that all ranks share), got scaling={self.scaling!r}"
            )

    @property
    def rowwise(self) -> bool:
        return self.scaling != "tensorwise"
