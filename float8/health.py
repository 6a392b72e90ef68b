"""Float8 health: what each cast does to the operands of every float8 linear, read in training.

For each converted linear and each operand its forward and input-gradient GEMMs cast (the
input x, the weight w, the output gradient g), on the steps it is armed:

    amax         the largest |value| of the high-precision operand
    scale        the multiplier the cast applied (the smallest one for per-row or per-block scales)
    underflow    the share of non-zero values that the cast sent to zero
    saturation   the share of non-zero values that landed on the float8 maximum
    underflow_norm_share   the share of the operand's squared L2 norm that those flushed values
                 held: what the flush removed from the GEMM, sum(x^2 flushed) / sum(x^2)
    saturation_norm_share  the share of the squared L2 norm lost to the values on the float8
                 maximum: sum((x - cast x)^2 over them) / sum(x^2)
    amax_growth  amax / the amax of the first health step of this process

The counts say how many values the cast touched; the norm shares say how much of the operand
that was, which is what a GEMM's result feels: most of a gradient's entries can be ~1e-8 of its
largest and flush to zero while holding under 1e-15 of its squared norm. The console warns on
the norm shares (UNDERFLOW_NORM_WARN, SATURATION_NORM_WARN), not on the counts.

The numbers come out of the float8 matmul itself, through a *probe*: a small leaf tensor
handed to the linear on armed steps, whose "gradient" the matmul's backward returns as the
stats of its three casts. That is plain autograd dataflow, so it works the same eager,
compiled, under activation checkpointing, FSDP and TP, and it changes no value the training
computes. The probe's gradient hook adds up the micro-batches of a step (max for amax, min for
scale, sums for the counts); `collect` reduces over the ranks and reads everything in one sync.

With the float8 FSDP all-gather the linear sees only the weight's float8 bytes: its weight
underflow is then the share of zero bytes (a weight is practically never exactly zero) and
its amax is recovered from the bytes (exact to float8 rounding), and its norm shares are NaN
(what the zero bytes held is gone).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

OPERANDS = ("input", "weight", "grad_output")
QUANTITIES = ("amax", "scale", "underflow", "saturation", "underflow_norm_share", "saturation_norm_share",
              "amax_growth")
# The columns of one operand's stats: amax, smallest scale, non-zero values, of those cast to
# zero, of those cast to +-max, the squared L2 norm, the squared norm the zeroed values held, the
# squared error of the values on +-max. All but the first two add up over micro-batches and ranks.
N_FIELDS = 8
# The console warns once per layer and operand past these shares of the squared norm: 1e-3 is
# the size of float8's own rounding error (e4m3 moves each value by up to 2**-4 of itself, ~1e-3
# of the squared norm on average; e5m2 by up to 2**-3), so below it the flush or the clipping
# costs less than the rounding every value pays anyway.
UNDERFLOW_NORM_WARN = 1e-3
SATURATION_NORM_WARN = 1e-3
AMAX_GROWTH_WARN = 100.0
# Module names that wrappers (activation checkpointing, compile) add and users never wrote.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def cast_stats(hp: torch.Tensor, data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The (N_FIELDS,) float64 stats of casting `hp` to the float8 `data` with `scale`."""
    values = data.to(torch.float32)
    nonzero = hp != 0
    flushed = nonzero & (values == 0)
    saturated = nonzero & (values.abs() == torch.finfo(data.dtype).max)
    amax = hp.abs().max().to(torch.float32)
    # Squares in float32 relative to amax (a flushed gradient entry ~1e-20 squared would vanish
    # in absolute float32), summed, then scaled back in float64 so micro-batches and ranks add up.
    unit = torch.where(amax > 0, amax, 1.0)
    relative = hp.to(torch.float32) / unit
    error = relative - values / (scale.to(torch.float32) * unit)
    squares = unit.double() ** 2
    return torch.stack([
        amax.double(),
        scale.min().double(),
        nonzero.sum().double(),
        flushed.sum().double(),
        saturated.sum().double(),
        relative.square().sum().double() * squares,
        torch.where(flushed, relative, 0.0).square().sum().double() * squares,
        torch.where(saturated, error, 0.0).square().sum().double() * squares,
    ])


def float8_bytes_stats(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stats of an operand known only by its float8 bytes: zero bytes count as underflow."""
    values = data.to(torch.float32)
    absolute = values.abs()
    return torch.stack([
        # Per element: a per-block scale is expanded to the data's shape.
        (absolute / scale).max().double(),
        scale.min().double(),
        torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device),
        (values == 0).sum().double(),
        (absolute == torch.finfo(data.dtype).max).sum().double(),
        *torch.full((3,), math.nan, dtype=torch.float64, device=values.device),
    ])


def no_stats(device: torch.device) -> torch.Tensor:
    """An operand its GEMM keeps in high precision: nothing to report."""
    return torch.full((N_FIELDS,), math.nan, dtype=torch.float64, device=device)


def merge_stats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two micro-batches' (..., N_FIELDS) stats as one: max amax, min scale, summed counts."""
    return torch.cat([
        torch.maximum(a[..., :1], b[..., :1]), torch.minimum(a[..., 1:2], b[..., 1:2]), a[..., 2:] + b[..., 2:],
    ], dim=-1)


def layer_name(module_name: str) -> str:
    for part in _WRAPPER_PARTS:
        module_name = module_name.replace(part, "")
    return module_name


@dataclasses.dataclass
class HealthReport:
    """One health step: metrics under `float8/` (per layer and the worst layer) and first-time warnings."""

    metrics: dict[str, float | str]
    warnings: list[str]


class Float8HealthMonitor:
    """Arms the float8 linears of `model` for one step and reads what their casts did.

        monitor = Float8HealthMonitor(model, device)
        monitor.arm()          # before the step's forward
        ...                    # forward and backward (any number of micro-batches)
        report = monitor.collect(group)   # after backward; disarms

    The linears are the modules with a `health_probe` attribute (Float8Linear).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.layers = [(layer_name(name), m) for name, m in model.named_modules() if hasattr(m, "health_probe")]
        self._probes = []
        self._pending: dict[int, torch.Tensor] = {}
        for i, _ in enumerate(self.layers):
            probe = torch.zeros(len(OPERANDS), N_FIELDS, dtype=torch.float64, device=device, requires_grad=True)
            probe.register_hook(self._recorder(i))
            self._probes.append(probe)
        self._first_amax: list[float] | None = None
        self._warned: set[tuple[str, str, str]] = set()
        self.armed = False

    def _recorder(self, i: int):
        def record(stats: torch.Tensor) -> None:
            earlier = self._pending.get(i)
            self._pending[i] = stats.detach() if earlier is None else merge_stats(earlier, stats.detach())

        return record

    def arm(self) -> None:
        for (_, module), probe in zip(self.layers, self._probes):
            module.health_probe = probe
        self.armed = True

    def disarm(self) -> None:
        for _, module in self.layers:
            module.health_probe = None
        for probe in self._probes:
            probe.grad = None
        self._pending.clear()
        self.armed = False

    def collect(self, group: dist.ProcessGroup | None = None) -> HealthReport:
        """This step's stats over every rank of `group` (all ranks call it), then disarm.

        A linear that ran no backward this step (none on a normal step) reports NaNs.
        """
        if not self.layers:
            self.disarm()
            return HealthReport({}, [])
        device = self._probes[0].device
        stats = torch.stack([self._pending.get(i, no_stats(device).expand(len(OPERANDS), N_FIELDS))
                             for i in range(len(self.layers))])
        self.disarm()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            # One MAX for amax and -scale, one SUM for the counts.
            extremes = torch.cat([stats[..., :1], -stats[..., 1:2]], dim=-1)
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
            counts = stats[..., 2:].contiguous()
            dist.all_reduce(counts, group=group)
            stats = torch.cat([extremes[..., :1], -extremes[..., 1:2], counts], dim=-1)
        return self._report(stats.tolist())

    def _report(self, rows: list[list[list[float]]]) -> HealthReport:
        if self._first_amax is None:
            self._first_amax = [r[0] for layer in rows for r in layer]
        metrics: dict[str, float | str] = {}
        warnings: list[str] = []
        worst: dict[tuple[str, str], tuple[float, str]] = {}
        for li, ((name, _), layer) in enumerate(zip(self.layers, rows)):
            for oi, (operand, row) in enumerate(zip(OPERANDS, layer)):
                amax, scale, nonzero, under, saturated, norm, under_norm, saturated_norm = row
                first = self._first_amax[li * len(OPERANDS) + oi]
                values = {
                    "amax": amax, "scale": scale,
                    "underflow": under / nonzero if nonzero > 0 else math.nan,
                    "saturation": saturated / nonzero if nonzero > 0 else math.nan,
                    "underflow_norm_share": under_norm / norm if norm > 0 else math.nan,
                    "saturation_norm_share": saturated_norm / norm if norm > 0 else math.nan,
                    "amax_growth": amax / first if first > 0 else math.nan,
                }
                for quantity, value in values.items():
                    metrics[f"float8/{name}/{operand}/{quantity}"] = value
                    if quantity != "scale" and _worse(value, worst.get((operand, quantity))):
                        worst[(operand, quantity)] = (value, name)
                warnings += self._warnings(name, operand, values)
        # The worst scale is the smallest: the operand with the largest amax.
        for operand in OPERANDS:
            scales = [(metrics[f"float8/{n}/{operand}/scale"], n) for n, _ in self.layers]
            finite = [s for s in scales if math.isfinite(s[0])]
            if finite:
                worst[(operand, "scale")] = min(finite)
        for (operand, quantity), (value, name) in sorted(worst.items()):
            metrics[f"float8/worst/{operand}/{quantity}"] = value
            metrics[f"float8/worst/{operand}/{quantity}/layer"] = name
        return HealthReport(metrics, warnings)

    def _warnings(self, name: str, operand: str, values: dict[str, float]) -> list[str]:
        found = []
        for quantity, limit, what in (
            ("underflow_norm_share", UNDERFLOW_NORM_WARN, "of its squared norm flushed to zero by the float8 cast"),
            ("saturation_norm_share", SATURATION_NORM_WARN, "of its squared norm clipped at the float8 maximum"),
            ("amax_growth", AMAX_GROWTH_WARN, "amax growth since the first float8 health step"),
        ):
            value = values[quantity]
            if math.isfinite(value) and value > limit and (name, operand, quantity) not in self._warned:
                self._warned.add((name, operand, quantity))
                if quantity == "amax_growth":
                    shown, limit_shown = f"{value:.1f}x {what}", f"{limit:g}x"
                else:
                    count = values[quantity.removesuffix("_norm_share")]
                    shown = f"{value:.2e} {what} ({count:.2%} of its non-zero values)"
                    limit_shown = f"{limit:g} of the squared norm"
                found.append(f"float8 health: {name} {operand}: {shown} (warning threshold "
                             f"{limit_shown}; docs/float8/trainer.md, 'Is float8 hurting my loss?')")
        return found


def _worse(value: float, current: tuple[float, str] | None) -> bool:
    return math.isfinite(value) and (current is None or value > current[0])

