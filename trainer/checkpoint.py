"""Distributed checkpoints (DCP): save atomically, resume exactly, load initial weights.

Layout under ``checkpoint.folder``::

    step-N/            a complete checkpoint (DCP shards + .metadata, extra.json, rng/)
    step-N.partial/    being written; never loaded, removed by the next save

A checkpoint becomes visible only by the rename of ``step-N.partial`` to ``step-N``,
done by rank 0 after every rank finished writing, so a process killed mid-save
leaves the previous checkpoint as the latest complete one.

Non-tensor state (step, tokens seen, dataloader position) is JSON and RNG states are
safetensors, so loading never unpickles anything.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainer.errors import UserError

if TYPE_CHECKING:
    from trainer.trainer import Trainer

_STEP_DIR = re.compile(r"^step-(\d+)$")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class _ModelAndOptimizer(Stateful):
    """Sharded model + optimizer state in fully qualified names, layout independent."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def complete_checkpoints(folder: Path) -> dict[int, Path]:
    """step -> path of each complete checkpoint in `folder`."""
    if not folder.is_dir():
        return {}
    found = {}
    for p in folder.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / ".metadata").is_file() and (p / "extra.json").is_file():
            found[int(m.group(1))] = p
    return dict(sorted(found.items()))


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _check_model_shapes(model: torch.nn.Module, shapes: dict[str, torch.Size], source: str) -> None:
    """Compare the full (unsharded) shapes the model expects with those in `source`."""
    expected = {k: v.shape for k, v in get_model_state_dict(model).items()}
    missing = [k for k in expected if k not in shapes]
    if missing:
        raise UserError(f"{source} lacks {len(missing)} model weights, e.g. '{missing[0]}' (a different model?)")
    for key, shape in expected.items():
        if tuple(shapes[key]) != tuple(shape):
            raise UserError(
                f"{source}: '{key}' has shape {tuple(shapes[key])} but the model needs {tuple(shape)} "
                "(check model.flavor / model.n_layers)"
            )


class CheckpointManager:
    """Saves and restores a Trainer's full state; loads initial weights for fresh runs."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        cfg = trainer.cfg.checkpoint
        self.cfg = cfg
        folder = Path(cfg.folder)
        self.folder = folder if folder.is_absolute() else Path(trainer.cfg.job.dump_folder) / folder
        self.last_loaded: Path | None = None
        self._pending: tuple[Any, Path, Path] | None = None
        self._last_saved_step = -1
        # Checkpoint collectives run on gloo, also next to NCCL, so async saves do not
        # compete with training collectives.
        self._pg = dist.new_group(backend="gloo") if cfg.enable and cfg.async_mode == "async" else None

    # -- save ----------------------------------------------------------------

    def maybe_save(self, force: bool = False) -> None:
        step = self.trainer.state.step
        if not self.cfg.enable or step == self._last_saved_step:
            return
        if force or step % self.cfg.interval == 0:
            self.save(step)

    def save(self, step: int) -> None:
        self._finish_pending()
        t = self.trainer
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}.partial"
        if t.is_main:
            self.folder.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            for stale in self.folder.glob("step-*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()
        (partial / "rng").mkdir(parents=True, exist_ok=True)
        save_file(_rng_state(), str(partial / "rng" / f"rank-{t.dist.rank}.safetensors"))
        if t.is_main:
            extra = {
                "train_state": t.state.state_dict(),
                "lr_scheduler": t.lr_scheduler.state_dict(),
                "dataloader": t.dataloader.state_dict(),
                "world_size": t.dist.world_size,
                "dp": t.dp,
                "tp": t.tp,
                "global_batch": t.cfg.training.batch_size * t.dp * t.cfg.training.gradient_accumulation_steps,
            }
            (partial / "extra.json").write_text(json.dumps(extra))
        app = {"app": _ModelAndOptimizer(t.model, t.optimizer)}
        if self.cfg.async_mode == "async":
            future = dcp.async_save(app, checkpoint_id=str(partial), process_group=self._pg)
            self._pending = (future, partial, final)
        else:
            dcp.save(app, checkpoint_id=str(partial))
            self._finalize(partial, final)
        self._last_saved_step = step

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        future, partial, final = self._pending
        future.result()
        self._pending = None
        self._finalize(partial, final)

    def _finalize(self, partial: Path, final: Path) -> None:
        dist.barrier()
        if self.trainer.is_main:
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            if self.cfg.keep_latest_k > 0:
                for _, old in list(complete_checkpoints(self.folder).items())[: -self.cfg.keep_latest_k]:
                    shutil.rmtree(old, ignore_errors=True)
            print(f"checkpoint saved: {final}", flush=True)
        dist.barrier()

    def close(self) -> None:
        self._finish_pending()

    # -- load ----------------------------------------------------------------

    def load_latest(self) -> bool:
        """Resume from the chosen checkpoint if one exists; else load initial weights if configured."""
        found = complete_checkpoints(self.folder) if self.cfg.enable else {}
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in found:
                have = ", ".join(str(s) for s in found) or "none"
                raise UserError(f"checkpoint.load_step = {self.cfg.load_step} not found in {self.folder} (complete: {have})")
            path = found[self.cfg.load_step]
        elif found:
            path = found[max(found)]
        else:
            if self.cfg.initial_load_path:
                self.load_initial_weights()
            return False
        self._load(path)
        self.last_loaded = path
        return True

    def _load(self, path: Path) -> None:
        t = self.trainer
        try:
            extra = json.loads((path / "extra.json").read_text())
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except (OSError, ValueError) as e:
            raise UserError(f"checkpoint {path} is unreadable: {_first_line(e)}") from None
        global_batch = t.cfg.training.batch_size * t.dp * t.cfg.training.gradient_accumulation_steps
        if extra.get("global_batch") != global_batch:
            raise UserError(
                f"checkpoint {path} was written with a global batch of {extra.get('global_batch')} sequences, this run "
                f"uses {global_batch} (batch_size x dp x accumulation); the data order would differ"
            )
        shapes = {
            k.removeprefix("app.model."): v.size
            for k, v in metadata.state_dict_metadata.items()
            if k.startswith("app.model.") and hasattr(v, "size")
        }
        _check_model_shapes(t.model, shapes, f"checkpoint {path}")
        try:
            dcp.load({"app": _ModelAndOptimizer(t.model, t.optimizer)}, checkpoint_id=str(path))
        except Exception as e:
            raise UserError(f"checkpoint {path} cannot be loaded: {_first_line(e)}") from None
        t.state.load_state_dict(extra["train_state"])
        t.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        t.dataloader.load_state_dict(extra["dataloader"])
        rng_file = path / "rng" / f"rank-{t.dist.rank}.safetensors"
        if rng_file.is_file():
            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])

    def load_initial_weights(self) -> None:
        """Model weights only (no optimizer state) from dcp / hf / meta / torch files."""
        from trainer.weights_io import load_dcp_model, load_full_state_dict

        t = self.trainer
        fmt, path = self.cfg.initial_load_format, self.cfg.initial_load_path
        if not Path(path).exists():
            raise UserError(f"checkpoint.initial_load_path not found: {path}")
        if fmt == "dcp":
            load_dcp_model(t.model, path)
        else:
            full_sd: dict[str, torch.Tensor] = {}
            shapes: dict[str, torch.Size] = {}
            if t.is_main:
                full_sd = load_full_state_dict(path, fmt)
                shapes = {k: v.shape for k, v in full_sd.items()}
            box = [shapes]
            dist.broadcast_object_list(box, src=0)
            _check_model_shapes(t.model, box[0], f"checkpoint.initial_load_path {path}")
            set_model_state_dict(
                t.model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            )
        if t.is_main:
            print(f"loaded initial weights ({fmt}) from {path}", flush=True)

    # -- export --------------------------------------------------------------

    def maybe_export_final(self) -> None:
        """Model-only safetensors export in checkpoint.export_dtype, for inference and SFT."""
        if not self.cfg.export_final:
            return
        t = self.trainer
        sd = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if t.is_main:
            from trainer.weights_io import export_model

            out = self.folder / "final"
            export_model(sd, t.model_args, out, _DTYPES[self.cfg.export_dtype])
            print(f"exported model weights: {out / 'model.safetensors'}", flush=True)
        dist.barrier()
