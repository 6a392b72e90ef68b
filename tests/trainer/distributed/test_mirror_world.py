"""parallelism.simulate_world_size: one process as rank 0 of N mirrored ranks takes FSDP2's N-rank path,
and the mirror's collectives are those of N ranks holding the same values."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import read_metrics, train_in_process
from trainer.config import build_config
from trainer.config.checks import validate
from trainer.distributed.mirror_world import MirrorProcessGroup
from trainer.errors import UserError


def _options(op: dist.ReduceOp.RedOpType, kind: type) -> object:
    opts = kind()
    opts.reduceOp = op
    return opts


def test_collectives_are_those_of_identical_ranks() -> None:
    group = MirrorProcessGroup(0, 4)
    x = torch.arange(6.0)
    group.allreduce([x], _options(dist.ReduceOp.SUM, dist.AllreduceOptions)).wait()
    assert torch.equal(x, torch.arange(6.0) * 4)
    group.allreduce([x], _options(dist.ReduceOp.MAX, dist.AllreduceOptions)).wait()
    assert torch.equal(x, torch.arange(6.0) * 4)

    gathered = torch.full((4, 3), -1.0)
    group._allgather_base(gathered, torch.tensor([1.0, 2.0, 3.0])).wait()
    assert torch.equal(gathered, torch.tensor([1.0, 2.0, 3.0]).expand(4, 3))
    in_place = torch.full((4, 3), -1.0)
    in_place[0] = torch.tensor([5.0, 6.0, 7.0])
    group._allgather_base(in_place, in_place[0]).wait()  # FSDP's: rank 0's slot is the input
    assert torch.equal(in_place, torch.tensor([5.0, 6.0, 7.0]).expand(4, 3))

    grads = torch.arange(8.0)
    summed, mean = torch.empty(2), torch.empty(2)
    group._reduce_scatter_base(summed, grads, _options(dist.ReduceOp.SUM, dist.ReduceScatterOptions)).wait()
    group._reduce_scatter_base(mean, grads, _options(dist.ReduceOp.AVG, dist.ReduceScatterOptions)).wait()
    assert torch.equal(summed, torch.tensor([0.0, 4.0])) and torch.equal(mean, torch.tensor([0.0, 1.0]))


@pytest.mark.version_specific
def test_one_process_takes_fsdps_four_rank_path(tmp_path, monkeypatch) -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    packed_for: list[int] = []
    copy_in = _fsdp_collectives.foreach_reduce_scatter_copy_in

    def recording_copy_in(grads: list[torch.Tensor], buffer: torch.Tensor, world_size: int) -> None:
        packed_for.append(world_size)
        copy_in(grads, buffer, world_size)

    monkeypatch.setattr(_fsdp_collectives, "foreach_reduce_scatter_copy_in", recording_copy_in)
    cfg = build_config([
        "--config", "configs/debug.toml", "--job.dump_folder", str(tmp_path), "--training.steps", "2",
        "--training.batch_size", "2", "--training.seq_len", "32", "--training.device", "cpu", "--model.n_layers", "2",
        "--validation.enable", "false", "--data.num_workers", "0", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--parallelism.simulate_world_size", "4",
    ])
    trainer = train_in_process(cfg)
    wq = trainer.model.layers["0"].attention.wq.weight
    assert wq.to_local().shape[0] * 4 == wq.shape[0]  # a quarter of the rows, as each of 4 GPUs holds
    assert packed_for and set(packed_for) == {4}  # every gradient packed into 4 chunks
    metrics = read_metrics(tmp_path)
    assert [r["step"] for r in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in metrics)


def test_refused_with_checkpoints_and_under_torchrun(tmp_path, monkeypatch) -> None:
    with pytest.raises(UserError, match=r"simulate_world_size .* set checkpoint\.enable = false"):
        validate(build_config(["--parallelism.simulate_world_size", "4", "--checkpoint.enable", "true"]))
    from trainer.trainer import Trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = build_config(["--parallelism.simulate_world_size", "4", "--job.dump_folder", str(tmp_path)])
    with pytest.raises(UserError, match="start it with python, not torchrun"):
        Trainer(cfg)
