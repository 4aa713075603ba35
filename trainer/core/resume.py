"""What may change when a run resumes, and from which checkpoint: checks only, nothing written.

`resume_run` applies the result (config.yaml, plan.json, the `resumed` event) and starts the workers
with `--resume <checkpoint>`; the worker restores step, schedule, data order and random state from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from trainer.core import launcher
from trainer.core.checkpoint import Checkpoint, latest_checkpoint
from trainer.core.config import Config, load_config, to_dict, to_yaml
from trainer.core.config.schema import iter_keys
from trainer.core.events import EventLog, PlanEvent, ResumedEvent, final_event, read_events
from trainer.core.hardware import Hardware
from trainer.core.launcher import RunProcess, plan_for
from trainer.core.plan import Plan
from trainer.core.runfolder import CONFIG_FILE, PID_FILE, RunFolder, write_atomic
from trainer.core.runlock import RunLock
from trainer.core.runlog import launcher_echo
from trainer.errors import UserError
from trainer.core.registry import spec_of
from trainer.core.family_spec import COMMON_FROZEN_ON_RESUME

def frozen_on_resume(family: str) -> tuple[str, ...]:
    """Settings a checkpoint was made with: changing them on resume would load state into a different model,
    optimizer or data order (or, for batch.total, silently change what a step means). Everything else (steps,
    learning rate, sampling, devices...) may change, and the `resumed` event lists what did."""
    return COMMON_FROZEN_ON_RESUME + spec_of(family).frozen_on_resume


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


def prepare_resume(run_dir: str | Path, overrides: Iterable[str] = (), hw: Hardware | None = None) -> ResumePlan:
    """Check that `run_dir` can continue with `overrides` on this machine; raises UserError saying why not."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not (run_dir / CONFIG_FILE).is_file():
        raise UserError(
            f"'{run_dir}' is not a run folder (it has no {CONFIG_FILE}). Pass a folder under runs/, e.g. "
            "--resume runs/my-run."
        )
    folder = RunFolder(run_dir)
    if final_event(read_events(run_dir)) is None and folder.is_alive():
        raise UserError(f"The run in '{run_dir}' is still running (see {PID_FILE}); stop it before resuming it.")
    old = load_config(run_dir / CONFIG_FILE, check_paths=False)
    config = load_config(run_dir / CONFIG_FILE, list(overrides))
    before, after = flat(old), flat(config)
    changes = {k: [before[k], after[k]] for k in before if before[k] != after[k]}
    frozen = [k for k in frozen_on_resume(old.model.family) if k in changes]
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
        old_total = folder.read_plan()["total"]
    except (OSError, ValueError, KeyError):
        old_total = plan.total
    if plan.total != old_total:  # the plan rounds a total that does not divide; a resume must not
        raise UserError(
            f"This run trained with batch {old_total} per step, which {plan.world_size} processes cannot split "
            f"evenly. Resume with devices set to a number of processes that divides {old_total}."
        )
    return ResumePlan(config, plan, checkpoint, changes)


def resume_run(
    run_dir: str | Path, overrides: Iterable[str] = (), worker_module: str = launcher.WORKER_MODULE,
    hw: Hardware | None = None,
    approve: Callable[[Config], None] | None = None,
) -> RunProcess:
    """Continue a stopped/failed run from its newest complete checkpoint (same step, schedule, data order),
    with `overrides` (e.g. train.steps=2000 to train longer). See `prepare_resume` for what may change.
    `approve(config)` may raise UserError to refuse the changed config (the web UI's workspace confinement)
    before anything is written. The run's lock is held from here until its workers end (trainer.core.runlock)."""
    run_dir = Path(run_dir).expanduser().resolve()
    folder = RunFolder(run_dir)
    if not folder.config.is_file():
        prepare_resume(run_dir, overrides, hw)  # says why this is not a run folder; nothing to lock
    lock = RunLock(run_dir).acquire()
    try:
        r = prepare_resume(run_dir, overrides, hw)
        if approve is not None:
            approve(r.config)
    except BaseException:
        lock.release()
        raise
    folder.stop_file.unlink(missing_ok=True)  # left from the stop being resumed; it would stop us at once
    folder.kill_file.unlink(missing_ok=True)  # the kill being resumed from; this launch was not killed
    write_atomic(folder.config, to_yaml(r.config))
    write_atomic(folder.plan, json.dumps(r.plan.event(), indent=2) + "\n")
    EventLog(run_dir, echo=launcher_echo(run_dir)).emit(ResumedEvent(
        step=r.checkpoint.step, checkpoint=str(r.checkpoint.path.relative_to(run_dir)),
        changes=r.changes, plan=PlanEvent.of(r.plan.event()), line=r.plan.line(),
    ))
    proc = launcher.start_run(run_dir, r.plan, r.config, resume=r.checkpoint.path, worker_module=worker_module)
    proc.resumed_from, proc.changes = r.checkpoint, r.changes
    return proc
