"""Process groups and device meshes.

A single process without torchrun goes through the same path as a sharded run: it
initialises a one-rank process group so FSDP2 (and its mixed precision) applies
identically, which keeps 1-process and N-process numerics comparable.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.config import Layout
from trainer.distributed.mirror_world import init_mirror_world
from trainer.log import warn


@dataclass
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str, timeout_s: int = 1800, simulate_world_size: int = 0) -> DistInfo:
    """Join torchrun's process group, or create a one-rank group when run directly; with
    `simulate_world_size` N, make this process rank 0 of a mirror world of N (mirror_world.py)."""
    if simulate_world_size:
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        init_mirror_world(simulate_world_size)
        return DistInfo(rank=0, local_rank=0, world_size=simulate_world_size, device=device)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ["WORLD_SIZE"])
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device_type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


# Outermost first, so consecutive ranks (one node's GPUs) share the inner dims: TP, whose collectives run
# in every block, then the FSDP shards; HSDP's replicas, which only all-reduce gradients, span nodes.
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class RunMesh:
    world: DeviceMesh  # MESH_DIMS
    # The two data-parallel dims flattened: the ranks that read different batches (the data loader's rank
    # and degree, the loss's token count, held-out totals). Kept here: torch deprecates slicing it from `world`.
    data_parallel: DeviceMesh


def build_mesh(device_type: str, layout: Layout) -> RunMesh:
    """The 3-D mesh of `layout` and its flattened data-parallel ranks."""
    world = init_device_mesh(device_type, (layout.replicate, layout.shard, layout.tp), mesh_dim_names=MESH_DIMS)
    return RunMesh(world, world["dp_replicate", "dp_shard"]._flatten("dp"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's mesh: the shard dim, or with more than one replica the 2-D (replicate, shard) mesh (HSDP:
    all-gathers and reduce-scatters within a shard group, then gradients all-reduced across replicas)."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


# How long the process group's destruction may take once every rank is past the final barrier: it
# takes well under a second, but gloo's teardown has hung now and then (CI of 2026-12-05: one rank of
# a finished 2-rank run exited, the other never returned), and torchrun waits for every worker.
DESTROY_TIMEOUT_S = 60.0


def shutdown(clean: bool, destroy_timeout_s: float = DESTROY_TIMEOUT_S) -> None:
    """Tear the process group down; `clean` (every rank finished) waits for the others first.

    After an error on some ranks a barrier could wait out the whole timeout for ranks
    that will never reach it, so only a clean exit synchronises. The barrier is not bounded
    (rank 0 may still be writing the final export); the destruction after it is: by then
    the run is saved, so a destruction that hangs or fails costs a warning, not the run.
    """
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    failure: list[BaseException] = []
    # A new thread starts on CUDA device 0: NCCL's communicators are torn down from this rank's.
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def destroy() -> None:
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            dist.destroy_process_group()
        except Exception as e:
            failure.append(e)

    thread = threading.Thread(target=destroy, name="process-group-destroy", daemon=True)
    thread.start()
    thread.join(destroy_timeout_s)
    if not clean:  # the run's error line is out; another would bury it
        return
    if thread.is_alive():
        warn(f"the process group's teardown did not finish in {destroy_timeout_s:g} s; leaving without it "
             "(the run had finished and saved)", every_rank=True)
    elif failure:
        first = (str(failure[0]).strip().splitlines() or [""])[0]
        warn(f"the process group's teardown failed ({type(failure[0]).__name__}: {first}); "
             "the run had finished and saved", every_rank=True)
