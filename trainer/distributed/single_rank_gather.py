"""FSDP2's parameter unshard at a data-parallel degree of 1: one launch per group, or no copy.

With one rank FSDP2 skips the all-gather and builds each unsharded parameter on its own in
`wait_for_unshard`: `all_gather_inputs` casts the fp32 shard into a new bf16 tensor, then
`copy_` moves that into the unsharded storage. That is two kernels, 10 bytes moved per
parameter and a few Python property calls per parameter, on the compute stream, twice per
step (forward, and backward's re-gather): about 20 ms of a 16-layer LLaMA-2-7B bf16 step on
one H200 (the 2026-12-01 trace). Here the shard is cast straight into the unsharded
storage, all parameters of a group in one `_foreach_copy_` (6 bytes per bf16 parameter).

A tensor subclass whose pre-all-gather output is kept between all-gathers
(`fsdp_all_gather_input_is_kept`: the float8 weight shards cast once per step, rewritten in
place) needs no copy at one rank: that output *is* the unsharded parameter's bytes. FSDP's
buffers are then pointed at it, and FSDP's reshard is kept from freeing it (it belongs to the
weight) by handing FSDP nothing to free. Other subclasses' outputs are copied as FSDP does,
in the same launch. The rest is FSDP's world-size-1 branch, unchanged: the unsharded
parameters are FSDP's own, initialised and swapped in by its own methods.

Only the `wait_for_unshard` of groups of one rank is replaced (an instance attribute: other
FSDP groups in the process keep the class's); tests/trainer/distributed/test_single_rank_gather.py checks the
weights, gradients and float8 bytes bitwise against FSDP's own path on every supported torch.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState, alloc_storage
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def _unsharded_source(fsdp_param: FSDPParam) -> tuple[torch.Tensor, torch.dtype]:
    """What the unsharded parameter is copied from, and its dtype (that of FSDP's all-gather input)."""
    plain = (
        fsdp_param.sharded_state == ShardedState.SHARDED
        and not fsdp_param.offload_to_cpu
        and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather")
    )
    if plain:
        shard = fsdp_param._sharded_param_data
        return shard, fsdp_param.param_dtype or shard.dtype
    source = fsdp_param.all_gather_inputs[0]
    return source, source.dtype


def _kept_input(fsdp_param: FSDPParam) -> torch.Tensor | None:
    """The subclass's pre-all-gather output when it is kept between all-gathers, else None."""
    if fsdp_param.offload_to_cpu or not getattr(fsdp_param._sharded_local_tensor, "fsdp_all_gather_input_is_kept", False):
        return None  # (an offloaded shard is cast anew from its copy on the device)
    (kept,) = fsdp_param.all_gather_inputs
    return kept


def _wait_for_unshard_single_rank(self: FSDPParamGroup) -> None:
    if not self._all_gather_result:
        return  # no preceding unshard
    if self._training_state == TrainingState.FORWARD and self.comm_ctx.all_gather_state:
        self._wait_all_gather_streams_on_event(self.comm_ctx.all_gather_state.event)
        self.comm_ctx.all_gather_state = None
    outputs, sources, kept = [], [], []
    for fsdp_param in self.fsdp_params:
        if (kept_input := _kept_input(fsdp_param)) is not None:
            fsdp_param.all_gather_outputs = [kept_input]
            fsdp_param._unsharded_inner_tensors = []  # a copy's storage, from an earlier step
            kept.append(fsdp_param)
            continue
        source, dtype = _unsharded_source(fsdp_param)
        fsdp_param.init_all_gather_outputs([source.numel()], [dtype], 1, self.device)
        output = fsdp_param.all_gather_outputs[0]
        alloc_storage(output)
        outputs.append(output)
        sources.append(source)
    if outputs:
        with torch.autograd._unsafe_preserve_version_counter(tuple(outputs)):
            torch._foreach_copy_(outputs, sources)
    for fsdp_param in self.fsdp_params:
        fsdp_param.init_unsharded_param()
    for fsdp_param in kept:
        fsdp_param.all_gather_outputs = []
        fsdp_param._unsharded_inner_tensors = []
    self._to_unsharded()
    copied = self.device_handle.Event()
    copied.record()
    self._wait_all_gather_streams_on_event(copied)
    self._all_gather_result = None


def use_single_rank_gather(model: nn.Module) -> None:
    """Give every FSDP parameter group of `model` over one rank the single-rank unshard."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and group._all_gather_process_group.size() == 1:
            group.wait_for_unshard = types.MethodType(_wait_for_unshard_single_rank, group)
