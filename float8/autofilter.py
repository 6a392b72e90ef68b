"""Which linears to convert, by timing them: keep in high precision every linear whose float8
forward + backward is not faster than bf16's at the run's tokens per micro-batch.

The reference libraries leave this choice to the user (torchao's filter has fixed H100 size
rules). Here, once at start-up on the run's GPU, one throwaway linear per distinct
(in_features, out_features) shape is timed in bf16 and in float8, eager or compiled as the
run is; `AutoFilter` turns the timings into a `module_filter_fn` whose skips say why:

    shapes = linear_shapes(model, config)      # fqn -> shape, of the linears the rules convert
    timings = time_linear_shapes(shapes.values(), tokens, config, compiled=True, device=device)
    report = convert_to_float8_training(model, config, AutoFilter(timings, tokens))
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from float8.config import Float8Config
from float8.convert import KeepHighPrecision, layer_names, rules_skip_reason
from float8.linear import Float8Linear

# (in_features, out_features) of a linear.
LinearShape = tuple[int, int]
# Untimed runs first: they compile (the run's graph, or the eager casts' kernels) and warm cuBLAS.
WARMUP_ITERS = 2
TIMED_ITERS = 7
# Every reason AutoFilter gives starts with this.
AUTO_REASON_PREFIX = "auto: "
# The rule AutoFilter's verdicts name (Float8ConversionReport.kept_by).
AUTO_RULE = "auto"
# Float8 must beat bf16 by this fraction: closer is a tie within timing noise (small shapes are
# launch-bound in both, e.g. 64x64 at 64 tokens compiled: 1.001 against 0.999 ms on an H200), and
# a tie keeps bf16, which costs no accuracy.
MIN_FLOAT8_GAIN = 0.03


@dataclass(frozen=True)
class ShapeTiming:
    """Milliseconds of one forward + backward of a linear of one shape, in bf16 and in float8."""

    bf16_ms: float
    float8_ms: float

    @property
    def float8_faster(self) -> bool:
        """Faster by at least MIN_FLOAT8_GAIN."""
        return self.float8_ms < self.bf16_ms * (1 - MIN_FLOAT8_GAIN)


# (shape, tokens, config, compiled, device) -> its timing; `time_linear_shape` is the real one.
Timer = Callable[[LinearShape, int, Float8Config, bool, torch.device], ShapeTiming]


def shape_text(shape: LinearShape) -> str:
    return f"{shape[0]}->{shape[1]}"


def linear_shapes(model: nn.Module, config: Float8Config) -> dict[str, LinearShape]:
    """fqn -> shape of every linear of `model` that `config`'s rules (filter_fqns, alignment,
    min_features) convert: the only ones worth timing."""
    return {
        fqn: (module.in_features, module.out_features)
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear) and not isinstance(module, Float8Linear)
        and rules_skip_reason(fqn, module, config) is None
    }


def time_linear_shape(
    shape: LinearShape, tokens: int, config: Float8Config, compiled: bool, device: torch.device
) -> ShapeTiming:
    """Forward + backward of `nn.Linear(in, out, bias=False)` in bf16 and of its Float8Linear on a
    (tokens, in) bf16 input, each the median of TIMED_ITERS runs timed by CUDA events."""
    if device.type != "cuda":
        raise ValueError(f"time_linear_shape times with CUDA events: device must be CUDA, got {device}")
    in_features, out_features = shape
    linear = nn.Linear(in_features, out_features, bias=False, device=device, dtype=torch.bfloat16)
    # Timed alone, outside FSDP: the weight stays a plain parameter whatever the all-gather setting.
    float8 = Float8Linear.from_float(linear, dataclasses.replace(config, fsdp_float8_all_gather=False))
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, out_features, device=device, dtype=torch.bfloat16)
    return ShapeTiming(_median_ms(linear, x, grad, compiled), _median_ms(float8, x, grad, compiled))


def _median_ms(linear: nn.Linear, x: torch.Tensor, grad: torch.Tensor, compiled: bool) -> float:
    forward = torch.compile(linear, fullgraph=True, dynamic=False) if compiled else linear

    def forward_backward() -> None:
        # autograd.grad rather than backward(): nothing accumulates into .grad between runs.
        torch.autograd.grad(forward(x), (x, linear.weight), grad)

    # The warm-up compiles: with dynamic=False each timed shape compiles the shared forward once
    # more, a recompile dynamo's per-function limit would refuse (fullgraph: an error) past 8
    # shapes. Lifted for the warm-up only, then restored.
    with torch._dynamo.config.patch(recompile_limit=sys.maxsize):
        for _ in range(WARMUP_ITERS):
            forward_backward()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(TIMED_ITERS)]
    for start, end in events:
        start.record()
        forward_backward()
        end.record()
    torch.cuda.synchronize(x.device)
    return statistics.median(start.elapsed_time(end) for start, end in events)


def time_linear_shapes(
    shapes: Iterable[LinearShape], tokens: int, config: Float8Config, compiled: bool, device: torch.device,
    timer: Timer | None = None,
) -> dict[LinearShape, ShapeTiming]:
    """Each distinct shape timed once by `timer` (default `time_linear_shape`), then each time taken
    as the slowest rank's (`slowest_over_ranks`): every rank of a process group must call this
    with the same shapes, and all then take the same decision."""
    timer = timer or time_linear_shape
    timings = {shape: timer(shape, tokens, config, compiled, device) for shape in sorted(set(shapes))}
    return slowest_over_ranks(timings)


def slowest_over_ranks(timings: dict[LinearShape, ShapeTiming]) -> dict[LinearShape, ShapeTiming]:
    """Each time as the slowest rank measured it (a step waits for its slowest rank), by one
    all-reduce MAX over the default process group; the timings as they are without one."""
    if not timings or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return timings
    # NCCL reduces CUDA tensors only; every other backend takes CPU ones.
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    times = torch.tensor([[t.bf16_ms, t.float8_ms] for t in timings.values()], dtype=torch.float64, device=on)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {shape: ShapeTiming(*row) for shape, row in zip(timings, times.tolist())}


def describe_shapes(shapes: Mapping[str, LinearShape], timings: Mapping[LinearShape, ShapeTiming] | None = None) -> str:
    """Each distinct shape with its layers, and with `timings` both times and the verdict:
    "4096->4096 (wq, wk, wv, wo x32): bf16 1.10 ms, float8 1.23 ms, kept in bf16"."""
    by_shape: dict[LinearShape, list[str]] = {}
    for fqn, shape in shapes.items():
        by_shape.setdefault(shape, []).append(fqn)
    parts = []
    for shape in sorted(by_shape):
        text = f"{shape_text(shape)} ({layer_names(by_shape[shape])})"
        if timings is not None:
            t = timings[shape]
            verdict = "float8" if t.float8_faster else "kept in bf16"
            text += f": bf16 {t.bf16_ms:.2f} ms, float8 {t.float8_ms:.2f} ms, {verdict}"
        parts.append(text)
    return "; ".join(parts)


@dataclass(frozen=True)
class AutoFilter:
    """A `module_filter_fn` from timings at `tokens` tokens: converts a linear whose shape float8
    runs faster, keeps the others in high precision with the shape and both times as the reason.
    A shape without a timing keeps the rules' decision (converted)."""

    timings: Mapping[LinearShape, ShapeTiming]
    tokens: int

    def keep_reason(self, shape: LinearShape) -> str | None:
        """Why a linear of `shape` stays in high precision, or None when float8 is faster."""
        timing = self.timings.get(shape)
        if timing is None or timing.float8_faster:
            return None
        return (
            f"{AUTO_REASON_PREFIX}{shape_text(shape)} float8 {timing.float8_ms:.2f} ms vs bf16 "
            f"{timing.bf16_ms:.2f} ms at {self.tokens} tokens, not {MIN_FLOAT8_GAIN:.0%} faster"
        )

    def __call__(self, module: nn.Module, fqn: str) -> bool | KeepHighPrecision:
        reason = self.keep_reason((module.in_features, module.out_features))
        return True if reason is None else KeepHighPrecision(reason, rule=AUTO_RULE)
