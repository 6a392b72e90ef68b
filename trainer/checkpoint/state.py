"""The tensors of a checkpoint: the model and the optimizer's state, through DCP.

DCP holds only tensors, in fully qualified names independent of the layout, so a checkpoint
resumes under another DP degree. The optimizer's param_groups (hyperparameters and the current
lr) are not tensors and go to extra.json (trainer/checkpoint/schema.py): DCP would pickle them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

# Where the model's tensors live among the DCP keys of a checkpoint.
MODEL_PREFIX = "app.model."


class ModelAndOptimizer(Stateful):
    """Sharded model + optimizer tensors, saved and loaded under the key ``app``.

    ``state_dict`` leaves the param_groups in ``saved_param_groups`` for the caller to store as
    JSON, and ``load_state_dict`` takes them from ``param_groups_to_load``.
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        param_groups_to_load: list[dict[str, Any]] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.saved_param_groups: list[dict[str, Any]] = []
        self.param_groups_to_load = param_groups_to_load or []

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        self.saved_param_groups = optim_sd["param_groups"]
        return {"model": model_sd, "optimizer": {"state": optim_sd["state"]}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        optim_sd = {"state": sd["optimizer"]["state"], "param_groups": self.param_groups_to_load}
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=optim_sd)


def nonfinite_weights(model: torch.nn.Module) -> torch.Tensor:
    """How many of this rank's (local shards of) parameters are NaN or infinite, as a device tensor."""
    count = torch.zeros((), dtype=torch.int64, device=next(model.parameters()).device)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            count += (~torch.isfinite(local)).sum()
    return count
