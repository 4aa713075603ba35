"""DDP: every process holds the whole model; accelerate wraps the trainable modules in
DistributedDataParallel, which all-reduces their gradients on the last micro-step of each optimizer step. One
process trains its modules unwrapped."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn


class DDP:
    shards_weights = False
    steps_in_backward = False

    def __init__(self, unwrap_model):
        self._unwrap_model = unwrap_model

    def shard(self, family) -> None:
        pass

    def wrap(self, family, accelerator, optimizer) -> None:
        modules = family.trainable_modules()  # built on the run's device by the family
        if accelerator.num_processes == 1:
            # A lone worker still has a process group (the step's reduction reads the same on 1 and N processes),
            # so accelerate would wrap a 1-rank DDP: its gradient buckets and hooks cost ~16 ms a step on the demo
            # and all-reduce with nobody (bench/README.md, vs_diffusers.py's findings).
            family.set_prepared(list(modules))
            return
        _frozen_weights_stay_local(modules)
        prepared = accelerator.prepare(*modules)
        family.set_prepared(list(prepared) if len(modules) > 1 else [prepared])

    def gathered(self, device=None, dtype=None):
        return nullcontext()

    def unwrap(self, module: nn.Module) -> nn.Module:
        return self._unwrap_model(module)

    def trained_parameters(self, optimizer) -> list[torch.Tensor]:
        return [p for group in optimizer.param_groups for p in group["params"]]

    def optimizer_state(self, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)


def _frozen_weights_stay_local(modules) -> None:
    """DDP broadcasts every parameter from rank 0 when it wraps a module. The frozen ones were loaded from the same
    files on every rank, so that is pure cost (FLUX: 24 GB at start-up), and gloo cannot send float8 at all
    (`model.base_weights: fp8`): DDP is told to leave them alone, and the float8 weights `model.fp8_compute`
    keeps as buffers too (DDP would otherwise send them again at every forward). Trainable ones are still
    broadcast, but for those a family already asked DDP to leave alone (a full fine-tune's swapped blocks, which
    trainer.families.components.block_swap averages itself): that list is kept."""
    from torch.nn.parallel import DistributedDataParallel

    for module in modules:
        frozen = list(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        frozen += [name for name, p in module.named_parameters() if not p.requires_grad]
        frozen += [name for name, b in module.named_buffers() if b.dtype == torch.float8_e4m3fn]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, sorted(set(frozen)))
