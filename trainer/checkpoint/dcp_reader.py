"""Reading DCP checkpoints without pickles: metadata, model keys and shapes, model-only loads.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle`` and its default
planner loads non-tensor ("bytes") entries with ``torch.load(weights_only=False)``. Our
checkpoints hold only tensors (non-tensor state is JSON, see ``trainer/checkpoint/schema.py``):
:class:`SafeFileSystemReader` unpickles the metadata through an allowlist and refuses a
checkpoint with any non-tensor entry, so reading a checkpoint never runs code from the file.
"""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from trainer.errors import UserError

# Keys of the model inside our DCP checkpoints (see trainer/checkpoint/state.py). Model-only
# DCP checkpoints (e.g. torchtitan's seed checkpoints) store the model keys bare.
DCP_MODEL_PREFIXES = ("app.model.", "model.", "")

# Everything a DCP .metadata pickle refers to (torch 2.4 .. 2.13).
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name} in checkpoint metadata")


class UnsafeCheckpointError(Exception):
    """A DCP checkpoint with an entry that loading would unpickle."""


class SafeFileSystemReader(dcp.FileSystemReader):
    """FileSystemReader that unpickles metadata through an allowlist and refuses non-tensor entries.

    Every DCP load (resume and initial weights) reads the metadata through this class on
    every rank, and DCP's planner only unpickles entries the metadata marks as bytes, so
    refusing those here covers model, optimizer and any other key.
    """

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f".metadata holds a {type(metadata).__name__}, not DCP metadata")
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                raise UnsafeCheckpointError(
                    f"'{key}' is stored as {type(md).__name__}, not a tensor; loading it would unpickle "
                    "it with torch.load(weights_only=False), and this trainer writes tensors only"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def describe_error(e: BaseException) -> str:
    """One line for an exception, looking inside DCP's CheckpointException for the real cause."""
    if isinstance(e, CheckpointException) and e.failures:
        inner = next(iter(e.failures.values()))
        e = inner[0] if isinstance(inner, tuple) else inner
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > 200:
        first = first[:200] + "..."
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def read_dcp_metadata(path: str | Path, what: str) -> Metadata:
    """The metadata of a DCP checkpoint directory, or a one-line UserError naming `what`."""
    if not (Path(path) / ".metadata").is_file():
        raise UserError(f"{what} {path} is not a complete DCP checkpoint (no .metadata)")
    try:
        return SafeFileSystemReader(str(path)).read_metadata()
    except UnsafeCheckpointError as e:
        raise UserError(f"{what} {path} refused: {e}") from None
    except UserError:  # Interrupted (a SIGTERM during start-up): not an unreadable file
        raise
    except Exception as e:
        raise UserError(f"{what} {path}: unreadable .metadata ({describe_error(e)})") from None


def dcp_model_shapes(metadata: Metadata, prefix: str) -> dict[str, torch.Size]:
    """Full shapes of the tensors under `prefix`, with the prefix removed."""
    return {
        key[len(prefix):]: md.size
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }


def check_model_keys(expected: dict[str, torch.Size], stored: dict[str, torch.Size], what: str) -> None:
    """Same keys and full shapes, else a one-line UserError that names the first difference."""
    missing = [k for k in expected if k not in stored]
    if missing:
        raise UserError(
            f"{what} lacks {len(missing)} model weights, e.g. '{missing[0]}' (a different model? "
            "check model.flavor / model.n_layers)"
        )
    extra = [k for k in stored if k not in expected]
    if extra:
        raise UserError(
            f"{what} has {len(extra)} weights this model lacks, e.g. '{extra[0]}' "
            "(check model.flavor / model.n_layers)"
        )
    for key, shape in expected.items():
        if tuple(stored[key]) != tuple(shape):
            raise UserError(
                f"{what}: '{key}' has shape {tuple(stored[key])} but the model needs {tuple(shape)} "
                "(check model.flavor / model.n_layers)"
            )


def dcp_model_prefix(metadata: Metadata, expected: Iterable[str]) -> str:
    """The prefix under which `metadata` stores the model: the one that holds the most of its keys."""
    keys = metadata.state_dict_metadata
    hits = {p: sum(p + k in keys for k in expected) for p in DCP_MODEL_PREFIXES}
    return max(DCP_MODEL_PREFIXES, key=lambda p: hits[p])


def load_dcp_model(model: nn.Module, path: str | Path, what: str = "checkpoint.initial_load_path") -> None:
    """Model weights from a DCP directory (a training checkpoint or a model-only one).

    Works for sharded models under a process group and for plain single-process models.
    """
    metadata = read_dcp_metadata(path, what)
    state = get_model_state_dict(model)
    prefix = dcp_model_prefix(metadata, state)
    stored = dcp_model_shapes(metadata, prefix)
    check_model_keys({k: v.shape for k, v in state.items()}, stored, f"{what} {path}")
    single = not torch.distributed.is_initialized()
    try:
        with warnings.catch_warnings():
            # DCP warns that it "assumes" a single process; here that is the point.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                {prefix + k: v for k, v in state.items()},
                storage_reader=SafeFileSystemReader(str(path)),
                no_dist=single,
            )
    except (Exception, CheckpointException) as e:
        raise UserError(f"{what} {path} cannot be loaded: {describe_error(e)}") from None
    set_model_state_dict(model, state)
