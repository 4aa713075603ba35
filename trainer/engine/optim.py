"""Optimizer and learning-rate schedule. Schedules count optimizer steps, never micro-steps or processes."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from trainer.core.config.schema import TrainConfig
from trainer.errors import UserError


def build_optimizer(groups: list[dict], train: TrainConfig) -> torch.optim.Optimizer:
    decay = train.decay()  # the key, or the optimizer's usual value
    if train.optimizer == "adamw":
        beta1, beta2 = train.betas  # two, validated
        return torch.optim.AdamW(groups, betas=(beta1, beta2), eps=train.eps, weight_decay=decay,
                                 **_kernel(groups))
    if train.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except Exception as exc:  # not installed, or built for another CUDA/torch
            raise UserError(f"train.optimizer adamw8bit needs bitsandbytes, which failed to import ({exc}); "
                            "install it with `pip install imagetune[bnb]` or use train.optimizer=adamw") from None
        return bnb.optim.AdamW8bit(groups, betas=tuple(train.betas), eps=train.eps, weight_decay=decay)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, weight_decay=decay, **_kernel(groups))
    if train.optimizer == "prodigy":
        from prodigyopt import Prodigy

        # Decoupled weight decay as AdamW's; the learning rate of each group multiplies the step size Prodigy
        # estimates (its `d`), so 1.0 is the norm. safeguard_warmup: without it d overshoots during a warmup.
        return Prodigy(groups, betas=tuple(train.betas), weight_decay=decay, decouple=True,
                       use_bias_correction=True, safeguard_warmup=train.warmup_steps > 0)
    if train.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # The fixed-step form (kohya's and OneTrainer's): train.lr is the step size and the schedule applies;
        # relative steps would ignore both.
        return Adafactor(groups, relative_step=False, scale_parameter=False, warmup_init=False,
                         weight_decay=decay)
    if train.optimizer == "adamw_schedulefree":
        from schedulefree import AdamWScheduleFree

        optimizer = AdamWScheduleFree(groups, betas=tuple(train.betas), eps=train.eps,
                                      weight_decay=decay, warmup_steps=train.warmup_steps)
        optimizer.train()  # it starts in eval mode and refuses to step there
        return optimizer
    raise UserError(f"train.optimizer: unknown optimizer {train.optimizer!r}")


def is_schedule_free(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.param_groups) and "train_mode" in optimizer.param_groups[0]


@contextmanager
def averaged_weights(optimizer: torch.optim.Optimizer):
    """Schedule-free AdamW trains on an interpolation (y) of its averaged weights (x) and its base sequence (z);
    x is what a user samples, evaluates and keeps. Inside, the parameters hold x; on exit they hold y again,
    copied back bit for bit rather than recomputed (eval() then train() is not exact in floating point), so a
    run that draws samples trains exactly like one that does not. Other optimizers: nothing happens."""
    if not is_schedule_free(optimizer):
        yield
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    training = [p.detach().clone() for p in params]
    optimizer.eval()  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, saved in zip(params, training):
                p.copy_(saved)
        for group in optimizer.param_groups:
            group["train_mode"] = True


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def kernel_choice(params) -> str:
    """"fused" or "foreach": how torch's AdamW / SGD step the trained tensors. Fused (one CUDA kernel for every
    parameter, instead of a few launches per tensor list) where every trained tensor is a plain floating CUDA
    tensor of a dtype it takes; foreach otherwise: FSDP's sharded DTensors, and the CPU, where it is bit for bit
    torch's for-loop (measured) and a little faster. (The CPU also has a fused AdamW since torch 2.4, 6x faster
    on 200 small tensors here, but one ulp away from the for-loop: the CPU runs keep their numbers.)"""
    from torch.distributed.tensor import DTensor

    params = list(params)
    fused = bool(params) and all(p.device.type == "cuda" and p.dtype in _FUSED_DTYPES and not isinstance(p, DTensor)
                                 for p in params)
    return "fused" if fused else "foreach"


def _kernel(groups: list[dict]) -> dict:
    return {kernel_choice(p for g in groups for p in g["params"]): True}


def describe(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer and its kernel, for the run's log: `AdamW (fused)`."""
    kernel = next((k for k in ("fused", "foreach") if optimizer.defaults.get(k)), None)
    return type(optimizer).__name__ + (f" ({kernel})" if kernel else "")


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig):
    from diffusers.optimization import get_scheduler

    # warmup is included in `steps` and capped by it, so a short run never stays in warmup forever
    warmup = min(train.warmup_steps, train.steps)
    name = "constant_with_warmup" if train.scheduler == "constant" and warmup else train.scheduler
    if train.optimizer == "adamw_schedulefree":
        warmup = 0  # its own warmup (train.warmup_steps is passed to it); validation keeps the schedule constant
        name = "constant"
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=train.steps,
                         num_cycles=train.scheduler_cycles, power=train.scheduler_power)
