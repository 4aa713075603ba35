"""What may change when a run resumes, and from which checkpoint: checks only, nothing written.

`launcher.resume_run` applies the result (config.yaml, plan.json, the `resumed` event) and starts the workers
with `--resume <checkpoint>`; the worker restores step, schedule, data order and random state from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from trainer.config import Config, load_config, to_dict
from trainer.config.schema import iter_keys
from trainer.errors import UserError
from trainer.events import final_event, read_events
from trainer.hardware import Hardware
from trainer.launcher import plan_for
from trainer.plan import Plan
from trainer.checkpoint import Checkpoint, latest_checkpoint
from trainer.runfolder import CONFIG_FILE, PID_FILE, PLAN_FILE
from trainer.runlock import recorded_pid

# Settings a checkpoint was made with: changing them on resume would load state into a different model,
# optimizer or data order (or, for batch.total, silently change what a step means). Everything else (steps,
# learning rate, sampling, devices...) may change, and the `resumed` event lists what did.
FROZEN_ON_RESUME = (
    "name", "model.family", "model.path", "model.config", "model.revision", "model.variant", "method", "seed",
    "batch.total", "data.path", "lora.rank", "lora.unet_targets", "lora.train_text_encoder",
    "lora.text_encoder_targets", "full.train_text_encoder", "full.ema", "train.optimizer", "prior.enabled",
    # detection: the starting weights decide frozen BatchNorm and frozen stages (the optimizer's parameters);
    # the validation split decides which images train
    "detection.weights", "detection.trainable_backbone_layers", "detection.val_path", "detection.val_fraction",
    "detection.images",
)


@dataclass(frozen=True)
class ResumePlan:
    config: Config
    plan: Plan
    checkpoint: Checkpoint
    changes: dict  # key -> [old, new]


def flat(config: Config) -> dict:
    """{dotted key: value} over every schema key."""
    data = to_dict(config)
    out = {}
    for key, _ in iter_keys():
        value = data
        for part in key.split("."):
            value = value[part]
        out[key] = value
    return out


def is_running(run_dir: Path) -> bool:
    if final_event(read_events(run_dir)) is not None:
        return False
    return recorded_pid(run_dir / PID_FILE) is not None


def prepare_resume(run_dir: str | Path, overrides: Iterable[str] = (), hw: Hardware | None = None) -> ResumePlan:
    """Check that `run_dir` can continue with `overrides` on this machine; raises UserError saying why not."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / CONFIG_FILE).is_file():
        raise UserError(
            f"'{run_dir}' is not a run folder (it has no {CONFIG_FILE}). Pass a folder under runs/, e.g. "
            "--resume runs/my-run."
        )
    if is_running(run_dir):
        raise UserError(f"The run in '{run_dir}' is still running (see {PID_FILE}); stop it before resuming it.")
    old = load_config(run_dir / CONFIG_FILE, check_paths=False)
    config = load_config(run_dir / CONFIG_FILE, list(overrides))
    before, after = flat(old), flat(config)
    changes = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
    frozen = [k for k in FROZEN_ON_RESUME if k in changes]
    if frozen:
        listed = ", ".join(f"{k} ({changes[k][0]!r} -> {changes[k][1]!r})" for k in frozen)
        raise UserError(
            f"Cannot change {listed} when resuming: the checkpoints were made with the old value. Resume without "
            f"it, or start a new run from this one's settings: python launch.py --preset {run_dir / CONFIG_FILE} "
            + " ".join(f"{k}={changes[k][1]}" for k in frozen)
        )
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        raise UserError(
            f"'{run_dir}' has no complete checkpoint to resume from (checkpoints/step-NNNNNN with a COMPLETE "
            "marker). Runs save one every checkpoint.every steps and when stopped; start the run again instead."
        )
    if checkpoint.step >= config.train.steps:
        raise UserError(
            f"The latest checkpoint is at step {checkpoint.step} and train.steps is {config.train.steps}: nothing "
            f"is left to train. To train longer, resume with a larger train.steps, e.g. "
            f"train.steps={checkpoint.step + max(100, checkpoint.step // 2)}."
        )
    plan = plan_for(config, hw)
    try:
        old_total = json.loads((run_dir / PLAN_FILE).read_text())["total"]
    except (OSError, ValueError, KeyError):
        old_total = plan.total
    if plan.total != old_total:  # the plan rounds a total that does not divide; a resume must not
        raise UserError(
            f"This run trained with batch {old_total} per step, which {plan.world_size} processes cannot split "
            f"evenly. Resume with devices set to a number of processes that divides {old_total}."
        )
    return ResumePlan(config, plan, checkpoint, changes)
