"""The run folder's event log: `events.jsonl`, one JSON object per line, flushed per line.

Each kind of event is a dataclass (trainer.core.event_types), written with `EventLog.emit(SampleEvent(...))` and
read back with `parse`. Torch-free: the launcher, `launch.py`'s progress bar and the web UI all read it. Every event has `type` and
`time`; a run ends with exactly one final event (`done`, `stopped` or `failed`).
"""

from __future__ import annotations

import fcntl
import json
import time
from dataclasses import replace
from pathlib import Path

from trainer.core.runfolder import EVENTS_FILE, RunFolder
from trainer.core.event_types import (  # noqa: F401  (the event kinds, for the writers)
    BadEvent, BestEvent, CheckpointEvent, DoneEvent, EvalEvent, Event, ExportEvent, FailedEvent, PlanEvent,
    ProgressEvent, ResumedEvent, SampleEvent, StoppedEvent, WarningEvent, parse)
from typing import Callable, Iterator

FINAL_TYPES = ("done", "stopped", "failed")


class EventLog:
    """Appends events to `<run>/events.jsonl`: rank 0, or the launcher before the workers start and after they
    end; an export (trainer.engine.export) may append beside them, which one write a line keeps whole.
    `echo(event)` also puts a line for people into train.log (trainer.core.runlog)."""

    def __init__(self, run_dir: str | Path, echo: Callable[[dict], None] | None = None):
        self.path = Path(run_dir) / EVENTS_FILE
        self.echo = echo  # trainer.core.runlog: the event's line in train.log, for people

    def emit(self, typed: Event) -> dict:
        event = replace(typed, time=round(time.time(), 3)).to_dict()
        line = json.dumps(event, default=_jsonable)
        # O_APPEND + one write per line: a reader never sees half a line, even while we write.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
        if self.echo is not None:
            self.echo(event)
        return event

    def emit_final(self, typed: Event) -> dict:
        """Write the run's ending unless one is already there, and return the ending that stands. Two processes
        may both see a run end without one (a terminal's launcher waiting on its workers, and a UI that killed
        them): the check and the write happen under one lock on the file, so the first writer's ending is the
        run's only one."""
        with open(self.path, "a", encoding="utf-8") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when f closes
            existing = final_event(read_events(self.path.parent))
            if existing is not None:
                return existing
            event = replace(typed, time=round(time.time(), 3)).to_dict()
            f.write(json.dumps(event, default=_jsonable) + "\n")
            f.flush()
        if self.echo is not None:
            self.echo(event)
        return event


def _jsonable(value):
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_events(run_dir: str | Path) -> list[dict]:
    """Every complete event so far (a line still being written is left for the next read)."""
    return list(iter_events(run_dir))


def iter_events(run_dir: str | Path, offset: int = 0) -> Iterator[dict]:
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


class EventFollower:
    """Reads new events as they are appended (for progress bars and the UI's polling)."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / EVENTS_FILE
        self.offset = 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        events = []
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode("utf-8"))
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return events


def final_event(events: list[dict]) -> dict | None:
    """The last final event, if the run has ended (a resumed run may have an earlier `stopped`)."""
    last = None
    for event in events:
        if event["type"] in FINAL_TYPES:
            last = event
        elif event["type"] == "resumed":
            last = None
    return last


def run_status(run_dir: str | Path) -> str:
    """`running`, `done`, `stopped`, `failed` or `unknown` (no events yet / the writer vanished)."""
    events = read_events(run_dir)
    final = final_event(events)
    if final:
        return final["type"]
    folder = RunFolder(Path(run_dir))
    if folder.pid_file.exists():
        return "running" if folder.is_alive() else "unknown"
    return "running" if events else "unknown"
