"""What one training process holds while it trains (`Run`), what a checkpoint restores besides weights
(`TrainState`), and how a run fails on every rank alike (`RunFailed`). Built by trainer.engine.worker, driven by
trainer.engine.loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.core.config import Config
from trainer.core.data.stream import BatchStream
from trainer.core.plan import Plan
from trainer.engine.parallel.fsdp import Sharding
from trainer.engine.precision import Amp


@dataclass
class TrainState:
    """What a checkpoint restores besides weights and optimizer: where we are."""

    step: int = 0
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0


@dataclass
class Run:
    config: object
    plan: object
    accelerator: object
    family: object
    stream: BatchStream
    optimizer: torch.optim.Optimizer
    scheduler: object
    amp: Amp
    events: object  # EventLog on rank 0, a no-op elsewhere
    stop: object  # StopRequest
    run_dir: Path
    state: TrainState = field(default_factory=TrainState)
    phase: str = "starting"  # what the processes are doing: named in the failure if a collective times out
    ema: object = None
    # FSDP or not (trainer.engine.parallel.fsdp); whole-weight work (samples, checkpoints, outputs) runs in `gathered()`
    sharding: Sharding = field(default_factory=lambda: Sharding(False, lambda module: module))

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    def trainable_params(self):
        return self.sharding.trained_parameters(self.optimizer)


class RunFailed(Exception):
    """The run cannot go on (non-finite losses, ranks out of sync); the message is the `failed` reason."""
