"""Atomic checkpoints: written into a temp folder, marked COMPLETE, then renamed into place; the last K kept.

A reader only ever considers `checkpoints/step-NNNNNN/` folders that hold the COMPLETE marker, so a crash or
a full disk while writing never leaves a checkpoint that a resume would pick up half-written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from trainer.core.runfolder import CHECKPOINTS_DIR as CHECKPOINTS
from typing import Callable, NamedTuple

COMPLETE = "COMPLETE"
_NAME = re.compile(r"^step-(\d{6,})$")


class CheckpointWriteError(OSError):
    """The checkpoint could not be written (disk full, permissions); the previous one is intact."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


class Checkpoint(NamedTuple):
    step: int
    path: Path


def complete_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Every complete checkpoint, oldest first. A folder without the COMPLETE marker was cut off mid-write
    (or is a `.tmp*` folder still being written): resuming from it is how other trainers resumed from corrupt state."""
    root = Path(run_dir) / CHECKPOINTS
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = _NAME.match(child.name)
            if match and child.is_dir() and (child / COMPLETE).is_file():
                found.append(Checkpoint(int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    run_dir: str | Path, step: int, writers: dict[str, Callable[[Path], None]], *, keep: int, info: dict
) -> Path:
    """Write each `writers[name](path)` into a new checkpoint for `step`; keep the newest `keep`.

    Raises CheckpointWriteError (with the OS's reason) if anything fails; the temp folder is removed and
    every earlier checkpoint is left as it was.
    """
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, write in writers.items():
            write(tmp / name)
        for file in tmp.iterdir():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        (tmp / COMPLETE).write_text(json.dumps({"step": step, **info}))
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (a stop right after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = exc.strerror or str(exc)
        raise CheckpointWriteError(
            exc.errno, f"could not write the checkpoint of step {step} in {final.parent}: {reason}"
        ) from exc
    prune(run_dir, keep)
    return final


def prune(run_dir: str | Path, keep: int) -> None:
    for _, folder in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(folder, ignore_errors=True)
