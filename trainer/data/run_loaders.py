"""The run's data loaders from its config: training and held-out data, each a path or a mixture of sources."""

from __future__ import annotations

from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.config import Config
from trainer.data.exchange import Exchange
from trainer.data.loader import build_dataloader
from trainer.data.sft import SFTOptions
from trainer.data.tokenizer import Tokenizer


def sft_options(cfg: Config) -> SFTOptions | None:
    return SFTOptions.from_config(cfg.data) if cfg.data.kind == "sft" else None


def run_loader(cfg: Config, section: str, num_workers: int, tokenizer: Tokenizer, dp_rank: int, dp: int,
               exchange: Exchange, verbose: bool) -> StatefulDataLoader:
    """The loader of [`section`] (data or validation: its path or its sources, named so in errors)
    with the run's data settings."""
    data = getattr(cfg, section)
    return build_dataloader(
        kind=cfg.data.kind, path=data.path, tokenizer=tokenizer, seq_len=cfg.training.seq_len,
        batch_size=cfg.training.batch_size, dp_rank=dp_rank, dp_degree=dp, seed=cfg.training.seed,
        text_field=cfg.data.text_field, data_format=cfg.data.format, sft_options=sft_options(cfg),
        bad_rows=cfg.data.bad_rows, num_workers=num_workers, exchange=exchange, verbose=verbose,
        option=f"{section}.path", sources=data.sources,
    )


def training_data_workers(cfg: Config) -> int:
    """data.num_workers, for each rank of a mirror world (parallelism.simulate_world_size): its one process
    reads every rank's rows, and with one rank's workers its training thread would wait for N ranks' tokenizing."""
    return cfg.data.num_workers * max(1, cfg.parallelism.simulate_world_size)


def data_summary(cfg: Config, loader: StatefulDataLoader, held_out: StatefulDataLoader | None) -> list[str]:
    """Startup lines about the sources of a mixture and the epochs their weights imply; none for a single path."""
    steps = cfg.training.steps
    micro_batches = steps * cfg.training.gradient_accumulation_steps
    lines = loader.dataset.describe("data.sources", micro_batches, f"{steps:,} steps")
    if held_out is not None:  # restarted for every evaluation, which reads validation.steps batches
        lines += held_out.dataset.describe("validation.sources", cfg.validation.steps, "each evaluation")
    return lines
