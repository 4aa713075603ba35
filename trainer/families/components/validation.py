"""The validation loss of the diffusion families (SD 1.x/2.x, SDXL, SD3, FLUX): `HeldOutLoss`, which a family
holds as its `evaluator` (trainer.families.protocol.HasEvaluator) when the run holds images out of training
(`data.val_split` or `data.val_path`); without them the family has none and the run never evaluates.

Each held-out image's loss is the family's own per-sample training loss (its `rows_loss`: the same noise
schedule, target and weighting, so no second copy of the maths), on rows of kind "val" (center crop, no flip:
see CaptionedLatents) drawn from a random stream of their own: image i's latent draw, noise and timestep come
from (seed, i, VAL_STREAM), so every evaluation sees the same draws, on any number of processes and after a
resume, and training never shares them.

Across processes: the images are cut into fixed micro-batches (one shape each, at most batch.per_device images,
independent of the number of processes) dealt round-robin to the ranks. Each rank writes its images' losses into
a vector of all of them; one all-reduce adds the vectors (every entry has a single writer, so the sum is exact)
and every rank adds the entries up in image order: the same number on 1 or N processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from trainer.core.data.holdout import configured
from trainer.families.components.base_weights import DTYPES
from trainer.families.components.captioned_latents import CaptionedLatents, Row
from trainer.families.protocol import WorkerContext

VAL_STREAM = 2  # the random stream of held-out rows: training images draw from stream 0, class images from 1

RowsLoss = Callable[[list[Row], int], torch.Tensor]
"""`rows_loss(rows, stream)`: per-sample losses (B,) of rows, through modules that no wrapper (DDP, DeepSpeed)
expects a backward of: the family's trained modules themselves."""


def held_out_loss(ctx: WorkerContext, data: CaptionedLatents, rows_loss: RowsLoss,
                  modules: Callable[[], Sequence[torch.nn.Module]]) -> HeldOutLoss | None:
    """The evaluator of a family whose run holds images out; None when it holds none (no evaluations)."""
    return HeldOutLoss(ctx, data, rows_loss, modules) if configured(ctx.config.data) else None


class HeldOutLoss:
    """`val_loss`: the mean loss over the held-out images (trainer.families.protocol.Evaluates); lower is better."""

    best_metric: str | None = "val_loss"
    best_mode = "min"

    def __init__(self, ctx: WorkerContext, data: CaptionedLatents, rows_loss: RowsLoss,
                 modules: Callable[[], Sequence[torch.nn.Module]]):
        self.ctx = ctx
        self.data = data
        self.rows_loss = rows_loss
        self.modules = modules  # the trained modules: in eval mode while evaluating (LoRA dropout off)

    def batches(self) -> list[list[int]]:
        """Held-out image indices in micro-batches of one pixel size each, a function of the images only."""
        per_device = self.ctx.config.batch.per_device
        size = per_device if isinstance(per_device, int) else 1
        by_size: dict[Any, list[int]] = {}
        for i in range(len(self.data.held_out)):
            by_size.setdefault(self.data.target(i, "val"), []).append(i)
        return [group[k:k + size] for group in by_size.values() for k in range(0, len(group), size)]

    def evaluate(self, step: int) -> dict:
        ctx = self.ctx
        losses = self.local_losses()
        if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(losses)
        values = losses.cpu().tolist()
        mean = math.fsum(values) / len(values)
        finite = math.isfinite(mean)
        if not finite:
            ctx.log_warning(f"step {step}: the validation loss is NaN or infinite; not reported")
        elif ctx.rank == 0:
            print(f"validation: step {step}: val_loss {mean:.6f} on {len(values)} held-out images", flush=True)
        return {"val_loss": mean if finite else None, "val_images": len(values)}

    def local_losses(self) -> torch.Tensor:
        """Every held-out image's loss (float64), this rank's images filled in and the others 0."""
        ctx = self.ctx
        batches = self.batches()
        mine = batches[ctx.rank::ctx.world_size]
        rounds = -(-len(batches) // ctx.world_size)
        losses = torch.zeros(len(self.data.held_out), dtype=torch.float64, device=ctx.device)
        modules = list(self.modules())
        modes = [m.training for m in modules]
        for m in modules:
            m.eval()
        try:
            with torch.no_grad(), self._autocast():
                for r in range(rounds):
                    # A rank short of batches computes one image and drops it: under FSDP every forward gathers
                    # the sharded weights, which every rank has to take part in.
                    indices = mine[r] if r < len(mine) else batches[0][:1]
                    batch = self.rows_loss([(i, 0, i, i, "val") for i in indices], VAL_STREAM)
                    if r < len(mine):
                        losses[indices] = batch.detach().to(losses)
        finally:
            for m, mode in zip(modules, modes):
                m.train(mode)
        return losses

    def eval_samples(self, step: int) -> list:
        return []  # the samples of the run's prompts already show what the model does

    def _autocast(self):
        """The training forward's precision (trainer.engine.precision.Amp): low-precision frozen weights meet fp32
        inputs only under autocast."""
        precision = self.ctx.plan.precision
        if precision == "fp32":
            return nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=DTYPES[precision])
