"""The run queue: runs waiting for the machine, kept in the runs folder so that it survives a restart and is shared
by every UI and command line on that folder. Torch-free.

    runs/.queue/<ns>-<name>.yaml     one queued run: its resolved config (validated when queued, and again
                                     by prepare_run when it starts); the queue's order is the names' order
    runs/.queue/.claimed/...         the entry a queue worker took (a rename: only one worker wins it)

Each operation is one rename or unlink, so two writers (two UIs, a UI and `launch.py --queue`) never see half an
entry: add = write a temp file and rename it in; cancel = unlink; take = rename into .claimed/.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from trainer.core.config import Config, load_config, to_yaml
from trainer.core.runfolder import RunFolder, check_run_name
from trainer.errors import UserError

QUEUE_DIR = ".queue"
CLAIMED = ".claimed"
T = TypeVar("T")
_ENTRY = re.compile(r"^(\d{19,})-([A-Za-z0-9][A-Za-z0-9._-]*)\.yaml$")


@dataclass(frozen=True)
class Queued:
    path: Path
    name: str  # the run's name (its folder gets this name, or name-2...)
    position: int  # 1 = next to start

    @property
    def id(self) -> str:
        return self.path.stem


def queue_dir(runs_dir: str | Path) -> Path:
    return Path(runs_dir).expanduser().resolve() / QUEUE_DIR


def add(runs_dir: str | Path, config: Config) -> Queued:
    """Queue a validated config (load_config validated it) at the end."""
    check_run_name(config.name)
    root = queue_dir(runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{time.time_ns():019d}-{config.name}.yaml"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.write_text(to_yaml(config), encoding="utf-8")
    os.replace(tmp, final)
    return next(q for q in entries(runs_dir) if q.path == final)


def entries(runs_dir: str | Path) -> list[Queued]:
    """The queued runs, next first."""
    root = queue_dir(runs_dir)
    if not root.is_dir():
        return []
    found = sorted((p for p in root.iterdir() if p.is_file() and _ENTRY.match(p.name)), key=lambda p: p.name)
    return [Queued(p, _ENTRY.match(p.name).group(2), i) for i, p in enumerate(found, 1)]  # type: ignore[union-attr]


def cancel(runs_dir: str | Path, entry_id: str) -> bool:
    """Remove a queued run; False if it is no longer queued (started or cancelled meanwhile)."""
    for q in entries(runs_dir):
        if q.id == entry_id:
            try:
                q.path.unlink()
                return True
            except FileNotFoundError:
                return False
    return False


def take(runs_dir: str | Path) -> tuple[Queued, Path] | None:
    """Claim the next queued run for this worker: (its entry, the claimed file), or None when the queue is empty.
    A rename claims it, so two workers never start the same run."""
    claimed = queue_dir(runs_dir) / CLAIMED
    for q in entries(runs_dir):
        claimed.mkdir(parents=True, exist_ok=True)
        target = claimed / q.path.name
        try:
            os.rename(q.path, target)
        except FileNotFoundError:
            continue  # cancelled, or another worker took it
        return q, target
    return None


def load_claimed(path: Path) -> Config:
    """The claimed run's config, validated again (a preset or the code may have changed since it was queued)."""
    return load_config(str(path))


def busy_runs(runs_dir: str | Path) -> list[str]:
    """The runs in the folder whose processes still run (they hold the devices)."""
    root = Path(runs_dir).expanduser()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and RunFolder(p).is_alive())


@contextmanager
def exclusive(runs_dir: str | Path) -> Iterator[None]:
    """The queue's lock (runs/.queue/.lock, flock): held from "is the machine free?" to the started run's process
    being recorded, so two starters (two UIs' runners, a UI's Start, a --queue-worker) never start two runs at once."""
    root = queue_dir(runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def start_next(runs_dir: str | Path, launch: Callable[[Config], T]) -> str | tuple[Queued, T | UserError]:
    """Under the queue's lock: "busy" while a run is alive, "empty" without a queued run; else the next entry,
    taken, and what `launch(config)` returned (it must return once the run's process is recorded: prepare_run and
    start_run), or the UserError that refused it (its config no longer validates)."""
    with exclusive(runs_dir):
        if busy_runs(runs_dir):
            return "busy"
        got = take(runs_dir)
        if got is None:
            return "empty"
        entry, claimed = got
        try:
            return entry, launch(load_claimed(claimed))
        except UserError as exc:
            return entry, exc
        finally:
            claimed.unlink(missing_ok=True)


def drain(runs_dir: str | Path, launch: Callable[[Config], T], wait: Callable[[T], int], say: Callable[[str], None],
          poll_s: float = 2.0) -> int:
    """Start the queued runs one after another, each once no run in the folder is alive, until the queue is empty;
    the number that did not end well. A run that fails, or whose config no longer validates, is reported and the
    queue goes on."""
    failures, waiting = 0, False
    while True:
        got = start_next(runs_dir, launch)
        if got == "empty":
            return failures
        if isinstance(got, str):  # "busy"
            if not waiting:
                say(f"waiting for {', '.join(busy_runs(runs_dir)) or 'a run'} to end before the next queued run")
            waiting = True
            time.sleep(poll_s)  # a poll of the runs folder, as the UI's
            continue
        waiting = False
        entry, started = got
        if isinstance(started, UserError):
            say(f"queued run {entry.name} was not started: {started}")
            failures += 1
            continue
        say(f"started queued run {entry.name}")
        failures += wait(started) != 0
