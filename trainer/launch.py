"""What the launcher tells a process before any process group exists: torchrun's environment
(run directly, one rank of one), and the device type a run asks for."""

from __future__ import annotations

import os

import torch


def launch_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launch_world_size() -> int:
    """torchrun's WORLD_SIZE; 1 when run directly."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_world_size() -> int:
    """Processes of this launch on this host (they share its memory)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ


def pick_device_type(requested: str) -> str:
    """`training.device` resolved: 'auto' is CUDA where there is a GPU."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested
