"""Optimizer and learning-rate schedule. Schedules count optimizer steps, never micro-steps or processes."""

from __future__ import annotations

import torch

from trainer.core.config.schema import TrainConfig
from trainer.errors import UserError


def build_optimizer(groups: list[dict], train: TrainConfig) -> torch.optim.Optimizer:
    if train.optimizer == "adamw":
        beta1, beta2 = train.betas  # two, validated
        return torch.optim.AdamW(groups, betas=(beta1, beta2), eps=train.eps, weight_decay=train.weight_decay,
                                 fused=_fusable(groups) or None)
    if train.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except Exception as exc:  # not installed, or built for another CUDA/torch
            raise UserError(f"train.optimizer adamw8bit needs bitsandbytes, which failed to import ({exc}); "
                            "install it with `pip install imagetune[bnb]` or use train.optimizer=adamw") from None
        return bnb.optim.AdamW8bit(groups, betas=tuple(train.betas), eps=train.eps, weight_decay=train.weight_decay)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, weight_decay=train.weight_decay)
    raise UserError(f"train.optimizer: unknown optimizer {train.optimizer!r}")


def _fusable(groups: list[dict]) -> bool:
    """AdamW's fused CUDA kernel (one launch for every parameter, instead of a few per tensor list) where every
    trained tensor is a plain CUDA tensor; FSDP's sharded DTensors and CPU runs keep the default implementation."""
    from torch.distributed.tensor import DTensor

    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_cuda and p.dtype == torch.float32 and not isinstance(p, DTensor) for p in params)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig):
    from diffusers.optimization import get_scheduler

    # warmup is included in `steps` and capped by it, so a short run never stays in warmup forever
    warmup = min(train.warmup_steps, train.steps)
    name = "constant_with_warmup" if train.scheduler == "constant" and warmup else train.scheduler
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=train.steps)
