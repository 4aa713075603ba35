"""What the loop writes into the run folder: samples, checkpoints (and reading them back on resume).

Rank 0 writes; the other ranks wait at a barrier (with the run's collective timeout) so that nobody races
ahead, and so that a sample or a checkpoint never races a second writer.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainer.families.protocol import HasCheckpointMetadata, evaluator_of
from trainer.core.events import BestEvent, CheckpointEvent, EvalEvent, SampleEvent, WarningEvent
from trainer.core.checkpoint import COMPLETE, CHECKPOINTS, CheckpointWriteError, latest_checkpoint, save_checkpoint
from trainer.engine.ema import ema_weights
from trainer.engine.optim import averaged_weights, is_schedule_free
from trainer.core.runfolder import BEST, SAMPLES_DIR as SAMPLES, RunFolder
from trainer.engine.scoring import prompt_scores, side_by_side
from trainer.families.components.trained_weights import sample_prompts



def _write_samples(run, step: int, indexed) -> None:
    """(index, caption, image) -> samples/step-NNNNNN-pKK.png and a `sample` event each (rank 0)."""
    run_folder = RunFolder(run.run_dir)
    run_folder.samples.mkdir(exist_ok=True)
    for i, prompt, image in indexed:
        path = run_folder.sample(step, i)
        tmp = path.with_name(f".{path.name}")
        image.save(tmp, format="PNG")
        tmp.rename(path)  # the UI never shows a half-written PNG
        run.events.emit(SampleEvent(step=step, prompt=prompt, index=i, path=f"{SAMPLES}/{path.name}"))


def draw_samples(run) -> None:
    step = run.state.step
    if run.parallel.shards_weights and not sample_prompts(run.config.sample):
        return  # nothing to draw (only diffusion families shard, and they draw prompts): skip gathering weights
    run.phase = f"rank 0 drawing samples at step {step}"
    # FSDP: rank 0 samples with a gathered copy, in bf16 under a bf16 plan (FLUX: 24 GB, not 48 GB of fp32)
    dtype = torch.bfloat16 if run.plan.precision == "bf16" else torch.float32
    with averaged_weights(run.optimizer), ema_weights(run), run.parallel.gathered(run.accelerator.device, dtype):
        if run.accelerator.is_main_process:
            samples = run.family.render_samples(step)
            _write_samples(run, step, ((i, prompt, side_by_side(images)) for i, (prompt, images) in enumerate(samples)))
            scores = prompt_scores(run.config.sample, samples)
            if scores:
                run.events.emit(EvalEvent(step=step, extra=scores))
        run.accelerator.wait_for_everyone()


def evaluate(run) -> None:
    """The run's metrics (if it has any: trainer.families.protocol.evaluator_of) as an `eval` event. Every rank
    takes part: metrics such as mAP or the validation loss are gathered across processes by the evaluator. Its
    `best_metric` (detection's `map`, the diffusion families' `val_loss`) keeps checkpoints/best/ (`eval.best`);
    its `eval_samples(step)` -> [(index, caption, image)] are written as samples (detection: the
    precision-recall curve)."""
    evaluator = evaluator_of(run.family)
    if evaluator is None:
        return
    step = run.state.step
    run.phase = f"evaluating at step {step}"
    with averaged_weights(run.optimizer), ema_weights(run):
        metrics = evaluator.evaluate(step)
        if metrics:
            run.events.emit(EvalEvent(step=step, extra=metrics))
        with run.parallel.gathered():
            if run.accelerator.is_main_process:
                _write_samples(run, step, evaluator.eval_samples(step))
                if metrics:
                    keep_best(run, metrics)
            run.accelerator.wait_for_everyone()


def _metadata(run, step: int) -> dict | None:
    """safetensors metadata of the family's weights files (detection: classes and model config), if any."""
    return run.family.checkpoint_metadata(step) if isinstance(run.family, HasCheckpointMetadata) else None


def read_best(run_dir) -> dict | None:
    """{"step", "metric", "value", "mode"} of checkpoints/best/, or None when there is none (complete)."""
    try:
        return json.loads((run_dir / CHECKPOINTS / BEST / COMPLETE).read_text())
    except (OSError, ValueError):
        return None


def best_rule(run) -> tuple[str, str] | None:
    """(metric, "max" | "min") that keeps checkpoints/best/: the evaluator's `best_metric` unless `eval.best`
    says none (validation refuses a metric the family does not report)."""
    evaluator = evaluator_of(run.family)
    choice = run.config.eval.best
    if evaluator is None or evaluator.best_metric is None or choice not in ("auto", evaluator.best_metric):
        return None
    return evaluator.best_metric, evaluator.best_mode


def _improves(value: float, previous: dict | None, name: str, mode: str) -> bool:
    if previous is None or previous.get("metric") != name or previous.get("value") is None:
        return True
    return value < previous["value"] if mode == "min" else value > previous["value"]


def keep_best(run, metrics: dict) -> None:
    """Rank 0: when the evaluator's `best_metric` beats checkpoints/best/, replace it (written in a temp folder,
    then swapped in by renames, so a reader sees the old or the new one, never half of one); a `best` event."""
    rule = best_rule(run)
    if rule is None:
        return
    name, mode = rule
    value = metrics.get(name)
    if value is None:
        return
    step = run.state.step
    previous = read_best(run.run_dir)
    if not _improves(value, previous, name, mode):
        return
    root = run.run_dir / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    tmp, old, final = root / f".tmp-{BEST}-{os.getpid()}", root / f".old-{BEST}-{os.getpid()}", root / BEST
    metadata = _metadata(run, step)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(run.family.trainable_state(), str(tmp / "trainable.safetensors"), metadata=metadata)
        (tmp / COMPLETE).write_text(json.dumps({"step": step, "metric": name, "value": value, "mode": mode}))
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():
            os.rename(old, final)
        run.events.emit(WarningEvent(step=step, message=f"could not write checkpoints/{BEST} ({exc.strerror or exc}); "
                                                                   "the previous best is kept. Free some disk space."))
        return
    run.events.emit(BestEvent(step=step, metric=name, value=value, mode=mode, path=f"{CHECKPOINTS}/{BEST}",
                              previous=previous.get("value") if previous else None))


def _fingerprint(run) -> torch.Tensor:
    params = run.trainable_params()
    total = sum(p.detach().double().sum() for p in params)
    absolute = sum(p.detach().double().abs().sum() for p in params)
    return torch.stack([torch.as_tensor(total), torch.as_tensor(absolute)]).to(run.accelerator.device)


def check_ranks_in_sync(run) -> None:
    """Trainable weights must be bit-identical on every rank (DDP all-reduces every trainable parameter).
    A mismatch means gradients went unsynchronised: fail loudly rather than train N different models."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = _fingerprint(run)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(everyone[0], other) for other in everyone[1:]):
        from trainer.engine.run import RunFailed

        raise RunFailed(f"The trainable weights differ between processes at step {run.state.step}: gradients "
                        "were not synchronised. This is a bug in the trainer; please report it with train.log.")


def save_run_checkpoint(run) -> None:
    step = run.state.step
    if not run.parallel.shards_weights:  # under FSDP each rank holds its own shard by design
        check_ranks_in_sync(run)
    run.phase = f"writing the checkpoint of step {step}"
    optimizer_state = run.parallel.optimizer_state(run.optimizer)  # FSDP: gathered from every rank
    # Schedule-free: the weights file holds the averaged weights a user wants; the ones it trains on travel in
    # training_state.pt, so a resumed run continues exactly.
    training = [p.detach().cpu().clone() for p in run.trainable_params()] if is_schedule_free(run.optimizer) else None
    with averaged_weights(run.optimizer), run.parallel.gathered():
        if run.accelerator.is_main_process:
            _write_run_checkpoint(run, step, optimizer_state, training)
        run.accelerator.wait_for_everyone()


def _write_run_checkpoint(run, step: int, optimizer_state: dict, training_weights: list | None) -> None:
    state = {
        "training_weights": training_weights,
        "train_state": vars(run.state).copy(),
        "optimizer": optimizer_state,
        "scheduler": run.scheduler.state_dict(),
        "amp": run.amp.state_dict(),
        "ema": run.ema.state_dict() if run.ema is not None else None,
    }
    writers = {
        "trainable.safetensors": lambda p: save_file(run.family.trainable_state(), str(p),
                                                     metadata=_metadata(run, step)),
        "training_state.pt": lambda p: torch.save(state, p),
    }
    try:
        path = save_checkpoint(run.run_dir, step, writers, keep=run.config.checkpoint.keep,
                               info={"world_size": run.plan.world_size})
        run.events.emit(CheckpointEvent(step=step, path=str(path.relative_to(run.run_dir))))
    except CheckpointWriteError as exc:
        previous = latest_checkpoint(run.run_dir)
        kept = f"the previous checkpoint {previous.path.name} is intact" if previous else "no earlier checkpoint exists"
        run.events.emit(WarningEvent(step=step, message=f"{exc}; {kept}. Free some disk space."))


def load_run_checkpoint(run, folder) -> None:
    """Restore weights, optimizer, schedule, scaler and position. Weights are loaded before DDP wraps the
    modules, so this runs in two parts: `load_weights` first, then this."""
    state = torch.load(folder / "training_state.pt", map_location="cpu", weights_only=False)
    configured = list(run.scheduler.base_lrs)  # from this launch's config: a resume may change train.lr
    run.parallel.load_optimizer_state(run.optimizer, state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scheduler.base_lrs = configured
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # get_lr() outside step() warns; here it is what we want
        current = run.scheduler.get_lr()
    for group, base, lr in zip(run.optimizer.param_groups, configured, current):
        group["initial_lr"], group["lr"] = base, lr
    run.scheduler._last_lr = list(current)
    if state.get("training_weights") is not None:  # schedule-free: the weights it trains on, not the averaged
        with torch.no_grad():
            for p, saved in zip(run.trainable_params(), state["training_weights"]):
                p.copy_(saved.to(p.device, p.dtype))
    run.amp.load_state_dict(state["amp"])
    if run.ema is not None and state.get("ema"):
        run.ema.load_state_dict(state["ema"])
    for key, value in state["train_state"].items():
        setattr(run.state, key, value)


def load_weights(family, folder) -> None:
    family.load_trainable_state(load_file(str(folder / "trainable.safetensors")))
