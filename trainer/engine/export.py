"""Outputs from a checkpoint: the files a finished run writes (the family's `save_outputs`: a LoRA's diffusers and
kohya files, a full model, a detector), for any complete checkpoint of a run, finished, stopped or killed.

    python launch.py --export RUN [--step N]      (which runs `python -m trainer.engine.export RUN_DIR --step N`:
                                                  export_checkpoint, in a process of its own that loads the model)
    checkpoint.export: true                       (export_run, in the training processes, after each checkpoint)

Both write through `write_outputs`, into output/step-NNNNNN/ (trainer.core.outputs says why a folder per step),
built in a temporary folder and renamed into place, so a download never gets half a file.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import trainer.families  # noqa: F401  (fills the family registry, trainer.core.registry)
from trainer.core.checkpoint import Checkpoint
from trainer.core.events import EventLog, ExportEvent, WarningEvent
from trainer.core.outputs import export_dir, pick_checkpoint
from trainer.core.runfolder import RunFolder
from trainer.core.runlog import launcher_echo
from trainer.errors import UserError


def write_outputs(family, run_dir: Path, step: int) -> list[str]:
    """family.save_outputs(output/step-NNNNNN/) of the weights `family` holds now; the paths, relative to the
    run folder. Replaces an earlier export of the same step."""
    final = export_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        written = family.save_outputs(tmp, step=step)
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return [os.path.relpath(final / Path(p).relative_to(tmp), run_dir) for p in written]


def export_run(run) -> None:
    """`checkpoint.export`: the outputs of the checkpoint just written, from the weights a user would get at the
    end (schedule-free's averaged ones, the EMA), with every rank in `gathered()` (FSDP) and rank 0 writing."""
    from trainer.engine.ema import ema_weights
    from trainer.engine.optim import averaged_weights

    step = run.state.step
    run.phase = f"rank 0 exporting the outputs of step {step}"
    with averaged_weights(run.optimizer), ema_weights(run), run.parallel.gathered():
        if run.accelerator.is_main_process:
            try:
                outputs = write_outputs(run.family, run.run_dir, step)
            except OSError as exc:  # a full disk costs the export, not the run
                run.events.emit(WarningEvent(step=step, message=f"could not export the outputs of step {step} "
                                                              f"({exc.strerror or exc}); free some disk space."))
            else:
                run.events.emit(ExportEvent(step=step, outputs=outputs))
        run.accelerator.wait_for_everyone()


def export_checkpoint(run_dir: Path, step: int | None = None) -> tuple[int, list[str]]:
    """Load the run's family with the checkpoint's weights (its EMA swapped in, if the run kept one) on one
    device and write its outputs; (step, paths relative to the run folder). Emits an `export` event."""
    import torch
    from accelerate import Accelerator

    from trainer.core.config.load import load_config
    from trainer.core.plan import Plan
    from trainer.engine.ema import build_ema
    from trainer.engine.run_io import load_weights
    from trainer.families import get_family
    from trainer.families.protocol import WorkerContext

    from trainer.engine.chatter import quiet_library_chatter

    quiet_library_chatter(run_dir)  # as in the training processes: only the lines that matter
    folder = RunFolder(run_dir)
    ckpt = pick_checkpoint(run_dir, step)
    config = load_config(folder.config, check_paths=False)
    plan = Plan.from_event(folder.read_plan())
    events = EventLog(run_dir, echo=launcher_echo(run_dir))  # the export's line in train.log too

    def log_warning(message: str) -> None:
        print(f"warning: {message}", flush=True)

    # One process, on the GPU when the run trained on one and this machine has it; otherwise the CPU.
    acc = Accelerator(cpu=not (plan.device == "cuda" and torch.cuda.is_available()))
    ctx = WorkerContext(config=config, plan=plan, run_dir=run_dir, cache_dir=run_dir.parent / ".cache",
                        device=acc.device, rank=0, world_size=1, accelerator=acc, log_warning=log_warning)
    family = get_family(config.model.family)(ctx)
    family.load()
    load_weights(family, ckpt.path)
    _swap_in_ema(family, config, plan, ckpt, build_ema, log_warning)
    outputs = write_outputs(family, run_dir, ckpt.step)
    events.emit(ExportEvent(step=ckpt.step, outputs=outputs))
    return ckpt.step, outputs


def _swap_in_ema(family, config, plan, ckpt: Checkpoint, build_ema, log_warning) -> None:
    """A run that keeps an EMA writes it as its outputs (trainer.engine.ema); the checkpoint's weights file holds
    the live weights and training_state.pt the average, over the optimizer's parameters in its order, which is
    the order of the family's parameter groups."""
    import torch

    params = [p for group in family.param_groups() for p in group["params"]]
    ema = build_ema(config, params)
    if ema is None:
        return
    state = torch.load(ckpt.path / "training_state.pt", map_location="cpu", weights_only=False).get("ema")
    if not state or plan.sharding == "fsdp":  # FSDP's average is of rank 0's shards only
        log_warning("this checkpoint holds no whole EMA of the weights: the trained weights are exported instead")
        return
    ema.load_state_dict(state)
    ema.copy_to(params)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainer.engine.export RUN_DIR [--step N]`, started by launch.py --export (which checked both,
    and prints the `export` event's files with what loads each)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        export_checkpoint(args.run_dir.resolve(), args.step)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
