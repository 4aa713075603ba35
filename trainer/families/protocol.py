"""The protocol every model family implements. The training loop talks to a family only through this.

A family owns its models, its dataset and its maths; the loop owns the step: accumulation, precision,
clipping, optimizer and scheduler, stopping, checkpoints and events. Adding a family is one module that
implements this class and one line in `trainer/families/__init__.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from PIL import Image

from trainer.core.config.schema import Config
from trainer.core.plan import Plan


@dataclass
class WorkerContext:
    """What a family gets from the worker: the config, the plan, this process's place and device."""

    config: Config
    plan: Plan
    run_dir: Path
    cache_dir: Path
    device: torch.device
    rank: int
    world_size: int
    accelerator: object  # accelerate.Accelerator (barrier, wait_for_everyone)
    log_warning: object  # callable(str): a `warning` event on rank 0 and a line in the log
    unwrap: object = None  # callable(module) -> the plain model to sample with or save (trainer.engine.parallel.fsdp)

    def __post_init__(self):
        if self.unwrap is None:
            self.unwrap = lambda module: self.accelerator.unwrap_model(module)


class Family(Protocol):
    name: str

    def __init__(self, ctx: WorkerContext): ...

    def load(self) -> None:
        """Load the models onto ctx.device, freeze what is frozen, add adapters, set dtypes."""

    def trainable_modules(self) -> list[torch.nn.Module]:
        """Modules with trainable parameters (the worker wraps them for DDP and hands them back)."""

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        """Receive the DDP-wrapped modules (same order) to use in `loss`."""

    def param_groups(self) -> list[dict]:
        """Optimizer parameter groups, each with `params` and `lr`."""

    def prepare_data(self) -> int:
        """Scan, check and cache the data (caches: one writer per file, the others wait); return the number of
        items per epoch (repeats included)."""

    # Optional: `item_buckets: list[int] | None`, set by `prepare_data`: the aspect-ratio bucket of each item (a
    # small integer per item, in item order). When it is there and not None, the worker builds a
    # `trainer.core.data.stream.BucketedStream`: every optimizer step's whole batch comes from one bucket, so the
    # samples handed to `loss` always share one shape. Families without buckets simply do not define it.

    def loss(self, positions: list[int]) -> torch.Tensor:
        """Mean loss of the samples at these stream positions (a micro-batch), called under autocast.

        Every random draw for a sample (augmentation, noise, timestep) is seeded from its position, so the
        result does not depend on how the global batch is split across processes and micro-steps."""

    def render_samples(self, step: int) -> list[tuple[str, Image.Image]]:
        """(caption, image) pairs showing what the model does now, drawn with fixed seeds/inputs so that
        samples of different steps compare (rank 0 only, outside autocast unless the frozen weights are low
        precision). For diffusion: the preset's sample prompts; for detection: predictions on fixed images."""

    # Optional: `evaluate(step) -> dict | None`, called on every rank every `eval.every` steps and at the end;
    # the dict becomes an `eval` event (rank 0's). Families without metrics simply do not define it.

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable weights for a checkpoint (fp32, unwrapped names)."""

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        """Write the final artifacts; return their paths relative to the run folder."""
