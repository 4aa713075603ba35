"""What one training process holds while it trains (`Run`), what a checkpoint restores besides weights
(`TrainState`), and how a run fails on every rank alike (`RunFailed`). Built by trainer.engine.worker, driven by
trainer.engine.loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.core.config import Config
from trainer.core.data.stream import BatchStream
from trainer.core.plan import Plan
from trainer.core.stopping import StopRequest
from trainer.engine.compile import NoCompile
from trainer.engine.parallel import Parallelism
from trainer.engine.precision import Amp
from trainer.families.protocol import Family


@dataclass
class TrainState:
    """What a checkpoint restores besides weights and optimizer: where we are."""

    step: int = 0
    nonfinite_in_row: int = 0
    nonfinite_total: int = 0


@dataclass
class Run:
    config: Config
    plan: Plan
    accelerator: Any  # accelerate.Accelerator
    family: Family
    stream: BatchStream
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LRScheduler
    amp: Amp
    events: Any  # EventLog on rank 0, a no-op elsewhere
    stop: StopRequest
    run_dir: Path
    # DDP, FSDP or DeepSpeed (trainer.engine.parallel): whole-weight work (samples, checkpoints, outputs) runs in
    # its `gathered()`
    parallel: Parallelism
    state: TrainState = field(default_factory=TrainState)
    phase: str = "starting"  # what the processes are doing: named in the failure if a collective times out
    ema: Any = None  # diffusers' EMAModel when full.ema or lora.ema is on (trainer.engine.ema)
    heartbeat: Any = None  # trainer.engine.heartbeat.Heartbeat: the launcher's view of this rank's progress
    input: Any = None  # trainer.engine.input.InputPipeline: each micro-batch's samples, loaded ahead of its step
    compiler: Any = field(default_factory=NoCompile)  # train.compile (trainer.engine.compile): what compiled when

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    def trainable_params(self):
        return self.parallel.trained_parameters(self.optimizer)


class RunFailed(Exception):
    """The run cannot go on (non-finite losses, ranks out of sync); the message is the `failed` reason."""
