"""A world of N ranks in one process: each GPU's share of an N-GPU run, measured on one GPU.

`parallelism.simulate_world_size = N` runs this process as rank 0 of N over a process group whose
collectives move nothing between ranks, since there are none: every rank is taken to hold what
this one holds (a mirror). An all-gather repeats this rank's input in every rank's slot; a
reduce-scatter gives the sum (or mean) of N copies of this rank's first chunk; an all-reduce the
sum of N copies. FSDP2 then takes its N-rank path, not its one-rank branch nor the one-GPU fast
path: parameters sharded N ways, the gradients packed by `chunk_cat` into N chunks, the gathered
weights copied out of the all-gather buffer, 1/N of the optimizer; so the step's device work is
that of each GPU of an N-GPU run, without the time its collectives spend on the links (the copies
here stand in for the writes NCCL's kernels make). Values stay finite, but they are not a real
run's: a gathered weight is N copies of one shard.

The group is a Python `ProcessGroup` registered as the "mirror" backend, the way torch's own
threaded test group is (torch/testing/_internal/distributed/multi_threaded_pg.py); torch 2.13
calls its single-tensor collectives `all_gather_single` / `reduce_scatter_single`, 2.11
`_allgather_base` / `_reduce_scatter_base`, so it answers to both.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "mirror"
_DEVICES = ("cpu", "cuda")
# What the collectives of this process's mirror world would have moved per GPU, in bus bytes as the dry
# run's communication plan counts them (trainer/distributed/comm_plan.py), by (group description, kind):
# the mesh's groups are described "mesh_<dim>". Emptied when a mirror world starts.
MOVED: Counter[tuple[str, str]] = Counter()


def _done(result: object) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _reduce_copies(tensor: torch.Tensor, op: dist.ReduceOp, copies: int) -> None:
    """`tensor` becomes the reduction of `copies` copies of itself."""
    if op == dist.ReduceOp.SUM:
        tensor.mul_(copies)
    elif op == dist.ReduceOp.PRODUCT:
        tensor.pow_(copies)
    # AVG, MIN, MAX, BAND and BOR of identical values are the value itself.


class MirrorProcessGroup(dist.ProcessGroup):
    """Rank 0 of `world_size` identical ranks."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self._world_size = world_size

    def _moved(self, kind: str, tensor_bytes: int, passes: int = 1) -> None:
        """A ring collective of a full tensor of `tensor_bytes`: each GPU sends `passes` x (n - 1) / n of it."""
        MOVED[self.group_desc, kind] += passes * tensor_bytes * (self._world_size - 1) / self._world_size

    def size(self) -> int:
        return self._world_size

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return dist.distributed_c10d._world.pg_names[self]

    @property
    def _device_types(self) -> list[torch.device]:
        # Read by torch's state-dict broadcast (the CPU weight init); a C++ group lists its backends' devices.
        return [torch.device(d) for d in _DEVICES]

    def _get_backend(self, device: torch.device) -> MirrorProcessGroup:
        # Asked of every group for each of its devices: under torch 2.11 and 2.13, each inductor cache
        # hit asks for the CUDA backend to lengthen NCCL timeouts, and the base class, which holds no
        # backend here, raised ("No backend type associated with device type cuda").
        return self

    def allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions = dist.AllreduceOptions()) -> dist.Work:  # noqa: B008
        for t in tensors:
            _reduce_copies(t, opts.reduceOp, self._world_size)
            self._moved("all-reduce", t.nbytes, passes=2)
        return _done(tensors)

    allreduce_coalesced = allreduce

    def barrier(self, opts: object = None) -> dist.Work:
        return _done(None)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        for t in tensors:  # the root's value is every rank's
            MOVED[self.group_desc, "broadcast"] += t.nbytes
        return _done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        for slots, source in zip(outputs, inputs, strict=True):
            self._moved("all-gather", source.nbytes * self._world_size)
            for slot in slots:
                if slot.data_ptr() != source.data_ptr():
                    slot.copy_(source)
        return _done(outputs)

    def _allgather_base(self, output: torch.Tensor, source: torch.Tensor, opts: object = None) -> dist.Work:
        self._moved("all-gather", output.nbytes)
        rows, flat = output.view(self._world_size, -1), source.reshape(-1)
        if flat.data_ptr() == rows.data_ptr():
            rows = rows[1:]  # FSDP gathers in place: rank 0's slot is the input itself
        rows.copy_(flat.expand_as(rows))
        return _done(output)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> dist.Work:
        for output, source in zip(outputs, inputs, strict=True):
            self._allgather_base(output, source)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def _reduce_scatter_base(self, output: torch.Tensor, source: torch.Tensor,
                             opts: dist.ReduceScatterOptions = dist.ReduceScatterOptions()) -> dist.Work:  # noqa: B008
        self._moved("reduce-scatter", source.nbytes)
        output.view(-1).copy_(source.view(self._world_size, -1)[0])
        _reduce_copies(output, opts.reduceOp, self._world_size)
        return _done(output)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: dist.ReduceScatterOptions = dist.ReduceScatterOptions()) -> dist.Work:  # noqa: B008
        for output, source in zip(outputs, inputs, strict=True):
            self._reduce_scatter_base(output, source, opts)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced


def init_mirror_world(world_size: int) -> None:
    """Make this process rank 0 of a mirror world of `world_size` ranks (the default process group)."""
    MOVED.clear()
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND, lambda store, rank, size, timeout: MirrorProcessGroup(rank, size), devices=list(_DEVICES)
        )
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=world_size)
