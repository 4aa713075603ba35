"""The protocol every model family implements. The training loop talks to a family only through this.

A family owns its models, its dataset and its maths; the loop owns the step: accumulation, precision,
clipping, optimizer and scheduler, stopping, checkpoints and events. A family is a folder under
trainer/families/ with a torch-free spec (trainer.core.family_spec) naming its implementation of `Family`.

Optional abilities are protocols of their own (`Fetches`, `Evaluates`, `HasEvaluator`, `HasCheckpointMetadata`,
`Bucketed`): the engine asks `isinstance(family, Evaluates)` instead of looking for attributes by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import torch
from PIL import Image

from trainer.core.config.schema import Config
from trainer.core.plan import Plan


class Sample(NamedTuple):
    """One sample of a micro-batch, as the batch stream (trainer.core.data.stream) places it."""

    position: int
    """Its place in the run's stream of samples: every random draw for it (augmentation, noise, timestep) is
    seeded from this, so the result does not depend on how the global batch is split across processes."""
    epoch: int
    index: int  # type: ignore[assignment]  # the field shadows tuple.index(), which nothing here calls
    """The dataset item (repeats expanded) the family loads."""


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
    accelerator: Any  # accelerate.Accelerator (barrier, wait_for_everyone)
    log_warning: Callable[[str], None]  # a `warning` event on rank 0 and a line in the log
    unwrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None  # the plain model to sample with or save

    def __post_init__(self):
        if self.unwrap is None:
            self.unwrap = lambda module: self.accelerator.unwrap_model(module)


class Family(Protocol):
    name: str
    prepared: list[torch.nn.Module]
    """The trainable modules as the parallel wrapper returned them (set by `set_prepared`); the loop
    accumulates gradients on these."""
    ema: Any
    """diffusers' EMAModel over the trained parameters when `full.ema` or `lora.ema` is on, else None (set by the
    worker, which swaps the averaged weights in for samples, evaluations and outputs: trainer.engine.ema)."""

    def __init__(self, ctx: WorkerContext): ...

    def load(self) -> None:
        """Load the models onto ctx.device, freeze what is frozen, add adapters, set dtypes."""

    def trainable_modules(self) -> list[torch.nn.Module]:
        """Modules with trainable parameters (the worker wraps them for DDP and hands them back)."""

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        """Receive the wrapped modules (same order) to use in `loss`."""

    def param_groups(self) -> list[dict]:
        """Optimizer parameter groups, each with `params` and `lr`."""

    def prepare_data(self) -> int:
        """Scan, check and cache the data (caches: one writer per file, the others wait); return the number of
        items per epoch (repeats included)."""

    def loss(self, samples: list[Sample]) -> torch.Tensor:
        """Mean loss of these samples (a micro-batch), called under autocast."""

    def render_samples(self, step: int) -> list[tuple[str, list[Image.Image]]]:
        """(caption, images) pairs showing what the model does now, drawn with fixed seeds/inputs so that
        samples of different steps compare (rank 0 only, outside autocast unless the frozen weights are low
        precision). For diffusion: each sample prompt with `sample.images_per_prompt` images; for detection:
        predictions on fixed images, one each. The engine writes each caption's images side by side."""

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable weights for a checkpoint (fp32, unwrapped names)."""

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        """Write the final artifacts; return their paths."""


@runtime_checkable
class Fetches(Protocol):
    """A family whose loss splits into CPU work on the samples (read, decode, augment, cached tensors) and the
    maths on the device: the input pipeline (trainer.engine.input) runs `fetch` ahead of the step, in DataLoader
    workers when `data.workers` > 0, and the step calls `loss_of`. `loss_of(samples, fetch(samples))` must equal
    `loss(samples)`, and `fetch` must be a pure function of the samples (every draw seeded by their positions)
    that touches no model and no device: it runs in forked processes."""

    def fetch(self, samples: list[Sample]) -> Any:
        """CPU tensors in lists, tuples and dicts (what the DataLoader pins and the step moves to the device)."""

    def loss_of(self, samples: list[Sample], fetched: Any) -> torch.Tensor: ...


@runtime_checkable
class ReducesGradients(Protocol):
    """A family holding trained parameters that DDP leaves alone (a full fine-tune's swapped blocks, in CPU memory:
    trainer.families.components.block_swap): every process calls `reduce_gradients` after the last micro-step's
    backward, before the loop clips and steps, to average them over the processes."""

    def reduce_gradients(self) -> None: ...


@runtime_checkable
class Evaluates(Protocol):
    """A family with metrics: `evaluate` runs on every rank every `eval.every` steps and at the end; its dict
    becomes an `eval` event (rank 0's). checkpoints/best/ follows `best_metric` (with `eval.best: auto`), which
    is better when higher (`best_mode` "max": detection's mAP) or lower ("min": the validation loss)."""

    best_metric: str | None
    best_mode: str

    def evaluate(self, step: int) -> dict | None: ...

    def eval_samples(self, step: int) -> list[tuple[int, str, Image.Image]]:
        """(index, caption, image) written as samples after an evaluation (detection: precision-recall)."""


@runtime_checkable
class HasEvaluator(Protocol):
    evaluator: Evaluates | None
    """What evaluates the family when the run asks for it (the diffusion families: their validation loss, when
    the run holds images out); None: the run has no evaluations, as for a family without `Evaluates`."""


def evaluator_of(family: Any) -> Evaluates | None:
    """What evaluates this run: the family itself (detection), the evaluator it holds, or nothing."""
    if isinstance(family, Evaluates):
        return family
    return family.evaluator if isinstance(family, HasEvaluator) else None


@runtime_checkable
class HasCheckpointMetadata(Protocol):
    def checkpoint_metadata(self, step: int) -> dict[str, str]:
        """safetensors metadata that makes a weights file loadable on its own (detection: classes, config)."""


@runtime_checkable
class Bucketed(Protocol):
    item_buckets: list[int] | None
    """Set by `prepare_data`: each item's aspect-ratio bucket (None when bucketing is off). The worker then
    builds a BucketedStream: every optimizer step's batch comes from one bucket, so a micro-batch's samples
    always share one shape."""
