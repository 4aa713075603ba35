"""The training loop: one optimizer step = `accumulation` micro-steps on every process, then one update.

Everything a step needs is in `Run` (trainer.engine.run, built by trainer.engine.worker). The loop owns accumulation, precision,
clipping, the non-finite guard, stopping, samples, checkpoints and progress events; the family owns the maths.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from trainer.core.data.stream import position_seed
from trainer.core.events import ProgressEvent, WarningEvent
from trainer.engine import faults
from trainer.engine.run import Run, RunFailed
from trainer.families.components.transfer import tensor_on
from trainer.families.protocol import Fetches, ReducesGradients
from trainer.core.telemetry import WIDTH, summarize
from trainer.engine.telemetry import RankClock
from trainer.engine.run_io import draw_samples, evaluate, save_run_checkpoint
from trainer.engine.export import export_run


def fit(run: Run) -> str:
    """Train from run.state.step to the plan's steps; returns "done" or "stopped" (raises RunFailed)."""
    cfg, plan, acc = run.config, run.plan, run.accelerator
    fault = faults.from_env()  # test-only: a stop or crash at an exact step (trainer.engine.faults)
    draw_samples(run)  # at the start (or the resumed step): what the model does before this session trains
    throughput = Throughput()
    clock = RankClock(acc.device)
    batches = run.input.from_step(run.state.step)
    fetches = run.family if isinstance(run.family, Fetches) else None
    for step in range(run.state.step, plan.steps):
        # Global randomness (LoRA dropout) is a function of the step, so a resumed run draws what an
        # uninterrupted one would have; per-sample draws come from each sample's own generator.
        torch.manual_seed(position_seed(cfg.seed, step, 1000 + run.rank))
        run.phase = f"step {step + 1}"
        clock.begin_step()
        losses = []
        for micro in range(plan.accumulation):
            began = time.perf_counter()
            fault.slow_input(run.rank)
            batch = next(batches)  # made ahead by the input pipeline (trainer.engine.input)
            clock.waited(time.perf_counter() - began)
            assert (batch.step, batch.micro) == (step, micro), "input pipeline out of step with the loop"
            with acc.accumulate(*run.family.prepared):
                with run.amp.autocast(), clock.forward():
                    if fetches is None:
                        loss = run.family.loss(batch.samples)
                    else:
                        loss = fetches.loss_of(batch.samples, batch.fetched_on(acc.device))
                acc.backward(run.amp.scale(loss))  # divides by the accumulation; DDP syncs on the last micro-step
            losses.append(loss.detach().float())
        assert acc.sync_gradients, "accumulation out of step with the optimizer"
        if isinstance(run.family, ReducesGradients):  # the gradients DDP does not average (block_swap.py)
            run.family.reduce_gradients()
        fault.before_vote(run.stop.stop_file, step + 1)
        began = time.perf_counter()
        mean_loss, finite, stop_requested, slots = _reduce_step(losses, run.stop.requested(), acc.device,
                                                                clock.figures(), run.rank, plan.world_size)
        clock.synced(time.perf_counter() - began)
        if finite:
            if not run.parallel.steps_in_backward:  # DeepSpeed clipped and stepped in the last backward
                run.amp.unscale(run.optimizer)
                if cfg.train.clip_norm():
                    torch.nn.utils.clip_grad_norm_(run.trainable_params(), cfg.train.clip_norm())
                if run.amp.step(run.optimizer) and run.ema is not None:
                    run.ema.step(run.trainable_params())
            run.state.nonfinite_in_row = 0
        else:  # DeepSpeed: its gradient norm was not finite either, so it skipped the update too
            _on_nonfinite(run, step + 1, mean_loss)
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        clock.end_step()
        run.state.step = step + 1
        if run.heartbeat is not None:
            run.heartbeat.stepped(run.state.step)
        fault.step_ended(run.rank, run.state.step)
        throughput.tick(plan.total, counted=not run.compiler.compiled(run.state.step))  # train.compile
        run.events.emit(ProgressEvent(step=run.state.step, steps=plan.steps,
                                      loss=mean_loss if math.isfinite(mean_loss) else None,
                                      lr=run.scheduler.get_last_lr()[0], samples_per_s=throughput.rate(),
                                      eta_s=throughput.eta(plan.steps - run.state.step, plan.total),
                                      epoch=round(run.stream.epoch_at(run.state.step), 3),
                                      **_rank_fields(slots, step, plan.world_size)))
        last = run.state.step == plan.steps
        if cfg.sample.every and run.state.step % cfg.sample.every == 0 and not last:
            draw_samples(run)
        if cfg.eval.every and run.state.step % cfg.eval.every == 0 and not last:
            evaluate(run)
        if stop_requested:
            save_run_checkpoint(run)
            if cfg.checkpoint.export:
                export_run(run)
            return "stopped"
        if cfg.checkpoint.every and run.state.step % cfg.checkpoint.every == 0 and not last:
            save_run_checkpoint(run)
            if cfg.checkpoint.export:  # the last step's outputs are the run's own, in output/
                export_run(run)
    draw_samples(run)
    evaluate(run)
    save_run_checkpoint(run)  # lets `--resume` with more steps extend a finished run
    return "done"


def _reduce_step(losses: list[torch.Tensor], stop: bool, device, figures: list[float], rank: int,
                 world_size: int) -> tuple[float, bool, bool, list[float]]:
    """One all-reduce per optimizer step: the mean loss over all ranks, whether every loss was finite, whether
    any rank was asked to stop (so all ranks stop after the same step), and every rank's telemetry of the step
    before (trainer.core.telemetry: each rank fills its own slots, the others are zero, so the sum is all).
    The losses' sums stay on the device and the host's values are copied there without waiting, so reading the
    result is the step's one host sync (trainer.families.components.transfer; tests/test_gpu_syncs.py)."""
    local = torch.stack(losses).double()
    finite = torch.isfinite(local)
    slots = [0.0] * (WIDTH * world_size)
    slots[rank * WIDTH:(rank + 1) * WIDTH] = figures
    counts = torch.stack([torch.where(finite, local, 0).sum(), finite.sum(), (~finite).sum()]).double()
    stats = torch.cat([counts, tensor_on([float(stop), *slots], device, torch.float64)])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    total, count, nonfinite, stop_votes, *reduced = stats.tolist()
    mean = total / count if count else float("nan")
    return mean, nonfinite == 0, stop_votes > 0, reduced


def _rank_fields(slots: list[float], step: int, world_size: int) -> dict:
    """The progress event's per-rank figures: those of the step before this one (none on a launch's first)."""
    if not any(slots):
        return {}
    return {"ranks_step": step, **summarize(slots, world_size)}


def _on_nonfinite(run: Run, step: int, mean_loss: float) -> None:
    run.state.nonfinite_in_row += 1
    run.state.nonfinite_total += 1
    limit = run.config.train.max_nonfinite_steps
    run.events.emit(WarningEvent(step=step, message=(
        f"step {step}: the loss was NaN/inf on some process; the update was skipped "
        f"({run.state.nonfinite_in_row} in a row, the run fails after {limit})")))
    if run.state.nonfinite_in_row >= limit:
        precision = run.plan.precision
        hint = " fp16 overflows easily: try precision=bf16 or fp32." if precision == "fp16" else ""
        raise RunFailed(
            f"The loss was NaN or infinite for {limit} optimizer steps in a row (up to step {step}), so training "
            f"stopped.{hint} A learning rate that is too high (train.lr={run.config.train.lr:g}) is the usual "
            f"cause; also check the dataset for broken images. The last checkpoint holds the weights from before "
            f"these steps: continue from it with a lower rate, e.g. "
            f"`python launch.py --resume {run.run_dir} train.lr={run.config.train.lr / 10:g}`.")


class Throughput:
    """Samples per second over the recent steps (the first step, with its warm-up, is not counted, nor a step
    during which something compiled: `counted=False` starts the window again at its end)."""

    def __init__(self, window: int = 20):
        self.times: list[float] = []
        self.window = window

    def tick(self, samples: int, counted: bool = True) -> None:
        self.times = (self.times if counted else [])[-self.window :] + [time.perf_counter()]
        self.samples = samples

    def rate(self) -> float | None:
        if len(self.times) < 2:
            return None
        return round(self.samples * (len(self.times) - 1) / (self.times[-1] - self.times[0]), 3)

    def eta(self, steps_left: int, samples_per_step: int) -> float | None:
        rate = self.rate()
        return round(steps_left * samples_per_step / rate, 1) if rate else None
