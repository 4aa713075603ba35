"""How the trained modules are spread over the processes: three implementations of `Parallelism`.

- `DDP` (ddp.py): every rank holds every weight; gradients are all-reduced. The default.
- `FSDP` (fsdp.py): weights, gradients and optimizer state sharded (ZeRO-3) with PyTorch's FSDP2.
- `DeepSpeedZero` (deepspeed.py): optimizer state (ZeRO-1) and gradients (ZeRO-2) partitioned by DeepSpeed.

The worker picks one from the plan (`for_plan`); the loop, samples and checkpoints talk only to this interface,
and checkpoints keep one format whichever wrote them, so a run can stop under one and resume under another.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn


class Parallelism(Protocol):
    shards_weights: bool
    """Whole weights exist only inside `gathered()` (FSDP); samples and outputs must enter it on every rank."""
    steps_in_backward: bool
    """The optimizer step happens inside the last micro-step's backward (DeepSpeed): the loop does not step."""

    def shard(self, family: Any) -> None:
        """Before the optimizer is built: replace the trainable parameters by their shards (FSDP)."""

    def wrap(self, family: Any, accelerator: Any, optimizer: torch.optim.Optimizer) -> None:
        """After: wrap the trainable modules (DDP, DeepSpeed) and hand them to `family.set_prepared`."""

    def gathered(self, device=None, dtype=None) -> AbstractContextManager:
        """Every rank enters; inside, `unwrap` gives modules with their full weights on rank 0."""

    def unwrap(self, module: nn.Module) -> nn.Module: ...

    def trained_parameters(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters the update changes, as this rank holds them."""

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """Every rank calls this; the full state in `optimizer.state_dict()` form (on rank 0 at least)."""

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None: ...


def for_plan(plan, accelerator) -> Parallelism:
    if plan.sharding == "fsdp":
        from trainer.engine.parallel.fsdp import FSDP

        return FSDP(accelerator.unwrap_model)
    if plan.sharding == "deepspeed":
        from trainer.engine.parallel.deepspeed import DeepSpeedZero

        return DeepSpeedZero(accelerator.unwrap_model, plan.zero_stage)
    from trainer.engine.parallel.ddp import DDP

    return DDP(accelerator.unwrap_model)
