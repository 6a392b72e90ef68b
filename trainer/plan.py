"""The run's plan: what a config means on this machine, resolved once before any process group,
weight or batch exists. The Trainer builds from it; `--job.dry_run true` prints it (trainer/dry_run.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.llama import LlamaArgs
from trainer.config import Config, check_layout, notes
from trainer.data.tokenizer import Tokenizer
from trainer.distributed.gradient_packing import GradientPacking, choose_gradient_packing
from trainer.distributed.memory_plan import MemoryEstimate, estimate_for, n_params
from trainer.distributed.single_rank_fast_path import FastPath, choose_fast_path
from trainer.errors import UserError
from trainer.float8_seam.seam import Float8RunContext, Float8Seam, build_seam, float8_memory
from trainer.launch import pick_device_type
from trainer.loss import choose_loss_compile
from trainer.metrics.logger import flops_per_token
from trainer.model_setup import model_args_for
from trainer.precision import ParamPrecision, resolve_param_precision
from trainer.run_facts import RunFacts


@dataclass(frozen=True)
class PrecisionLabels:
    """The run's precision as each output says it, built once from the resolved parameter dtype and the float8 seam."""

    run_name: str  # in the default run name: bf16, fp32 or the float8 recipe
    summary: str  # the startup summary's
    plan: str  # the dry run's

    @staticmethod
    def of(float8: Float8Seam, params: ParamPrecision, reduce_dtype: str) -> PrecisionLabels:
        return PrecisionLabels(
            run_name=float8.run_name_precision(params.dtype),
            summary=float8.describe(f"params {params.dtype} ({params.reason})"),
            plan=f"{float8.plan_precision(params.dtype)}; params {params.dtype} ({params.reason}), reduce {reduce_dtype}",
        )


@dataclass(frozen=True)
class RunPlan:
    """Layout, precision, float8 choices, memory estimate and the tokenizer of one run.

    `float8` is the run's seam, built but not yet given a model: the Trainer and the dry run convert
    their meta model with it. `tokenizer` is None in the dry run, which reads no data.
    """

    device_type: str
    params: ParamPrecision
    tokenizer: Tokenizer | None
    model_args: LlamaArgs
    facts: RunFacts
    # Parameters without the embedding: the 6N of the FLOPs per token.
    params_without_embedding: int
    # TP keeps the logits sharded on the vocab (parallelism.loss_parallel).
    vocab_sharded_logits: bool
    # The cross-entropy runs compiled (compile.loss with a compile mode; plain logits only): trainer/loss.py.
    loss_compiled: bool
    compile_text: str
    fast_path: FastPath
    gradient_packing: GradientPacking
    # Set when the packing is not the one the config asked for (an untested torch).
    gradient_packing_text: str | None
    float8: Float8Seam
    precision: PrecisionLabels
    memory: MemoryEstimate
    # The parameter dtype's warning and the config's notes: warnings, not errors.
    notes: tuple[str, ...]

    @staticmethod
    def resolve(cfg: Config, world_size: int, load_tokenizer: bool = True) -> RunPlan:
        """The plan of `cfg` over `world_size` processes; one-line UserErrors for what cannot run (no CUDA,
        a tokenizer that does not load or fit, a layout that does not divide, float8 unavailable)."""
        device_type = pick_device_type(cfg.training.device)
        if device_type == "cuda" and not torch.cuda.is_available():
            raise UserError("training.device = 'cuda' but no CUDA device is available")
        params = resolve_param_precision(cfg.training.mixed_precision_param, device_type)
        tokenizer = Tokenizer(cfg.model.tokenizer_path) if load_tokenizer else None
        args = model_args_for(cfg, tokenizer.n_words if tokenizer else None, device_type)
        layout = check_layout(cfg, world_size, args.n_heads, args.n_kv_heads)
        vocab_sharded_logits = layout.tp > 1 and cfg.parallelism.loss_parallel
        loss_compiled, compile_text = choose_loss_compile(cfg.compile.mode, cfg.compile.loss, vocab_sharded_logits)
        fast_path = choose_fast_path(cfg.parallelism.single_rank_fast_path, layout.dp)
        # Float8 off gives a no-op seam: nothing that uses the plan asks whether float8 is on.
        float8 = build_seam(cfg.float8, Float8RunContext.for_run(cfg, device_type, params.dtype, fast_path.on))
        precision = PrecisionLabels.of(float8, params, cfg.training.mixed_precision_reduce)
        packing, packing_text = choose_gradient_packing(cfg.parallelism.gradient_packing)
        total, _ = n_params(args)
        without_embedding = total - args.vocab_size * args.dim
        facts = RunFacts.for_run(
            cfg, layout, params.dtype, precision.run_name, total,
            flops_per_token(without_embedding, args.n_layers, args.dim, cfg.training.seq_len),
        )
        return RunPlan(
            device_type=device_type, params=params, tokenizer=tokenizer, model_args=args, facts=facts,
            params_without_embedding=without_embedding, vocab_sharded_logits=vocab_sharded_logits,
            loss_compiled=loss_compiled, compile_text=compile_text,
            fast_path=fast_path, float8=float8,
            gradient_packing=packing, gradient_packing_text=packing_text, precision=precision,
            # Replicas hold the whole of their shard group's state: the weights are split over the shards only.
            memory=estimate_for(cfg, args, device_type, layout.shard, layout.tp, params.dtype, vocab_sharded_logits,
                                loss_compiled, float8_memory(cfg.float8, fast_path.on)),
            notes=(*([params.warning] if params.warning else []), *notes(cfg)),
        )

    def fsdp_text(self) -> str | None:
        """What the startup summary and the dry run add to the layout about FSDP2's own machinery."""
        return "; ".join(t for t in (self.fast_path.text, self.gradient_packing_text) if t) or None

    def warnings(self, device: torch.device) -> list[str]:
        """The plan's notes and the float8 seam's advice for `device`, once the seam has converted the
        model; the advice raises UserError for float8 this device cannot run."""
        # The all-gather advice is about FSDP's all-gathers: those within a shard group.
        return [*self.notes, *self.float8.advice(device, self.facts.layout.shard, self.facts.tp)]
