"""The run queue: runs waiting for the machine, kept in the runs folder so that it survives a restart and is shared
by every UI and command line on that folder. Torch-free.

    runs/.queue/<ns>-<name>.yaml     one queued run: its resolved config (validated when queued, and again
                                     by prepare_run when it starts); the queue's order is the names' order
    runs/.queue/.claimed/...         the entry a queue worker took (a rename: only one worker wins it)
    runs/.queue/.claims/...          short jobs outside the queue that wait for devices or hold them (a Generate
                                     of the web UI): trainer.core.claims

Each operation is one rename or unlink, so two writers (two UIs, a UI and `launch.py --queue`) never see half an
entry: add = write a temp file and rename it in; cancel = unlink; take = rename into .claimed/; move = a rename to
a number between its new neighbours'.

A queued run waits only for the runs that hold its devices: one on GPUs 2,3 starts beside a run on GPUs 0,1, not
beside one on GPU 2 (or on every GPU, `devices: auto`); CPU runs share the CPU, so they wait for each other. It
never starts before an earlier queued run that waits for the same devices.

Queued runs wait for a running claim as for a run, and let a waiting claim go first (trainer.core.claims).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar


import yaml

# Who holds which devices (live runs, claims) and the queue's lock: trainer.core.claims; named here as well, as
# the queue's vocabulary (queue.Devices, queue.busy_runs, queue.exclusive...).
from trainer.core.claims import (Devices, busy_runs, claims, exclusive, live_runs,  # noqa: F401
                                 overlap, queue_dir, run_devices)
from trainer.core.config import Config, load_config, to_yaml
from trainer.core.config.validate import parse_devices
from trainer.core.runfolder import check_run_name
from trainer.errors import UserError

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


def move(runs_dir: str | Path, entry_id: str, by: int) -> str | None:
    """Move a queued run `by` places (-1: one earlier, 1: one later): its new id (the number in it is its place),
    or None if it is no longer queued or already first (last). One rename gives it a number between its new
    neighbours'."""
    with exclusive(runs_dir):
        queued = entries(runs_dir)
        index = next((i for i, q in enumerate(queued) if q.id == entry_id), None)
        if index is None or by == 0 or not 0 <= index + by < len(queued):
            return None
        slot = index + by  # its place among the others: between others[slot - 1] and others[slot]
        for _ in range(2):
            others = [q for q in queued if q.id != queued[index].id]
            numbers = [_number(q) for q in others]
            low = numbers[slot - 1] if slot > 0 else numbers[0] - _GAP
            high = numbers[slot] if slot < len(numbers) else numbers[-1] + _GAP
            if high - low >= 2:
                break
            try:
                queued = _spread(queued)  # neighbours one apart (queued in the same microsecond): make room
            except FileNotFoundError:
                return None  # one was cancelled meanwhile: the caller looks again
        entry = queued[index]
        target = entry.path.with_name(f"{(low + high) // 2:019d}-{entry.name}.yaml")
        try:
            os.rename(entry.path, target)
        except FileNotFoundError:
            return None  # taken or cancelled meanwhile
        return target.stem


_GAP = 2_000_000_000


def _number(q: Queued) -> int:
    return int(q.id.split("-")[0])


def _spread(queued: list[Queued]) -> list[Queued]:
    """The entries renumbered at least _GAP apart, in the same order at every moment: each number only grows, and
    the last is renamed first."""
    numbers: list[int] = []
    for q in queued:
        numbers.append(max(_number(q), numbers[-1] + _GAP if numbers else 0))
    spread = list(queued)
    for i in reversed(range(len(queued))):
        target = queued[i].path.with_name(f"{numbers[i]:019d}-{queued[i].name}.yaml")
        if target != queued[i].path:
            os.rename(queued[i].path, target)
        spread[i] = Queued(target, queued[i].name, queued[i].position)
    return spread


def _claim(runs_dir: str | Path, q: Queued) -> Path | None:
    """Claim queued run `q` for this worker (a rename: two workers never start the same run); None if it is gone."""
    claimed = queue_dir(runs_dir) / CLAIMED
    claimed.mkdir(parents=True, exist_ok=True)
    target = claimed / q.path.name
    try:
        os.rename(q.path, target)
    except FileNotFoundError:
        return None  # cancelled, or another worker took it
    return target


def take(runs_dir: str | Path) -> tuple[Queued, Path] | None:
    """Claim the next queued run: (its entry, the claimed file), or None when the queue is empty."""
    for q in entries(runs_dir):
        target = _claim(runs_dir, q)
        if target is not None:
            return q, target
    return None


def config_devices(devices: object) -> Devices:
    """The devices a config's `devices` value takes."""
    try:
        kind, value = parse_devices(devices)
    except ValueError:
        return None
    if kind == "cpu":
        return frozenset({"cpu"})
    if kind == "gpu_ids":
        return frozenset(f"gpu:{i}" for i in value)  # type: ignore[union-attr]
    return None


def entry_devices(q: Queued) -> Devices:
    try:
        return config_devices((yaml.safe_load(q.path.read_text(encoding="utf-8")) or {}).get("devices", "auto"))
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return None


def load_claimed(path: Path) -> Config:
    """The claimed run's config, validated again (a preset or the code may have changed since it was queued)."""
    return load_config(str(path))


def must_wait(runs_dir: str | Path, devices: Devices) -> bool:
    """Whether a new run on `devices` must queue: a live run or a claim holds (or waits for) one of them, or a
    queued run waits for one."""
    return bool(busy_runs(runs_dir, devices)) or any(overlap(devices, c.devices) for c in claims(runs_dir)) or \
        any(overlap(devices, entry_devices(q)) for q in entries(runs_dir))


def start_next(runs_dir: str | Path, launch: Callable[[Config], T]) -> str | tuple[Queued, T | UserError]:
    """Under the queue's lock: "empty" without a queued run, "busy" while each entry's devices are held (or wanted
    by an earlier entry or a waiting claim); else the first entry whose devices are free, taken, and what
    `launch(config)` returned (it must return once the run's process is recorded: prepare_run and start_run), or
    the UserError that refused it (its config no longer validates)."""
    with exclusive(runs_dir):
        queued = entries(runs_dir)
        if not queued:
            return "empty"
        now = claims(runs_dir)
        held = [run_devices(p) for p in live_runs(runs_dir)] + [c.devices for c in now if c.running]
        # The devices of earlier entries that wait (waiting claims come first): a later one must not jump them.
        waiting: list[Devices] = [c.devices for c in now if not c.running]
        for q in queued:
            need = entry_devices(q)
            if any(overlap(need, d) for d in held + waiting):
                waiting.append(need)
                continue
            claimed = _claim(runs_dir, q)
            if claimed is None:
                continue
            try:
                return q, launch(load_claimed(claimed))
            except UserError as exc:
                return q, exc
            finally:
                claimed.unlink(missing_ok=True)
        return "busy"


def waits_for(runs_dir: str | Path) -> tuple[str, list[str]] | None:
    """(the next queued run that waits, what holds its devices), for "waiting for ..."; None if none waits."""
    for q in entries(runs_dir):
        holders = busy_runs(runs_dir, entry_devices(q))
        if holders:
            return q.name, holders
    return None


def drain(runs_dir: str | Path, launch: Callable[[Config], T], poll: Callable[[T], int | None],
          say: Callable[[str], None], poll_s: float = 2.0) -> int:
    """Start the queued runs as their devices come free (one on GPUs 2,3 beside a run on GPUs 0,1), until the queue
    is empty and the runs this started have ended; the number that did not end well. `poll(started)` is None while
    a started run runs, then its exit code. A run that fails, or whose config no longer validates, is reported
    and the queue goes on."""
    failures, said = 0, ""
    running: dict[str, T] = {}
    while True:
        got = start_next(runs_dir, launch)
        if isinstance(got, tuple):
            entry, started = got
            if isinstance(started, UserError):
                say(f"queued run {entry.name} was not started: {started}")
                failures += 1
            else:
                say(f"started queued run {entry.name}")
                running[entry.name] = started
            continue  # another may start beside it
        for name, proc in list(running.items()):
            code = poll(proc)
            if code is not None:
                del running[name]
                failures += code != 0
                say(f"run {name} {'ended' if code == 0 else f'failed (exit code {code})'}")
        if got == "empty" and not running:
            return failures
        blocked = waits_for(runs_dir) if got == "busy" else None
        line = f"waiting for {', '.join(blocked[1])} to end before queued run {blocked[0]}" if blocked else ""
        if line and line != said:
            say(line)
        said = line
        time.sleep(poll_s)  # a poll of the runs folder, as the UI's
