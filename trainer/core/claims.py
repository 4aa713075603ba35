"""Who holds which devices: the live runs of a runs folder (their plan.json) and claims, short jobs outside the run
queue (trainer.core.queue builds on this module) that take devices by its rules, so that they never share a GPU with a training (two models on one GPU would each crawl or run out of memory) nor the CPU's cores with a
CPU training (on 2 cores two at once ran at a tenth of one's speed). The web UI's Generate is one. Torch-free.

    runs/.queue/.claims/<ns>-<pid>.json   {what, devices, owner (pid and start time), running}

A claim waits while a live run, a running claim or an earlier waiting claim holds one of its devices (a
generation on GPU 1 does not wait for a run on GPU 0), then starts its process under the queue's lock and holds
the devices until that process ends: queued runs wait for it as for a run. A waiting claim goes before the queued
runs (the queue's start_next lets it): it is a minute's work that someone is watching, a queued run is hours that
nobody is. A claim whose owner died (the UI that waited, or the process it started) holds nothing; each file is
written whole (a rename), as the queue's entries. The queue's lock (`exclusive`) is defined here, for both.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from trainer.core.runfolder import RunFolder
from trainer.core.runlock import identity, parse_identity, pid_alive
from trainer.errors import UserError

QUEUE_DIR = ".queue"
CLAIMS = ".claims"

# Devices as sets of names ("gpu:2", "cpu"); None: every device (`auto`, a GPU count: which ones is known only at
# the start), which overlaps everything.
Devices = frozenset[str] | None


def queue_dir(runs_dir: str | Path) -> Path:
    return Path(runs_dir).expanduser().resolve() / QUEUE_DIR


def run_devices(run_dir: Path) -> Devices:
    """The devices a started run holds: its plan's (auto resolved), from plan.json."""
    try:
        devices = json.loads(RunFolder(run_dir).plan.read_text(encoding="utf-8")).get("devices")
    except (OSError, ValueError, AttributeError):
        return None
    if devices == "cpu":
        return frozenset({"cpu"})
    if isinstance(devices, list) and all(isinstance(d, int) for d in devices):
        return frozenset(f"gpu:{d}" for d in devices)
    return None


def overlap(a: Devices, b: Devices) -> bool:
    return a is None or b is None or bool(a & b)


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


def live_runs(runs_dir: str | Path) -> list[Path]:
    """The run folders whose process (torchrun, or the one worker) still runs."""
    root = Path(runs_dir).expanduser()
    return [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and RunFolder(p).is_alive()] \
        if root.is_dir() else []


def busy_runs(runs_dir: str | Path, devices: Devices = None) -> list[str]:
    """What holds any of `devices` (None: any device): the runs in the folder whose processes still run, then the
    running claims (their `what`)."""
    return sorted(p.name for p in live_runs(runs_dir) if overlap(devices, run_devices(p))) + \
        [c.what for c in claims(runs_dir) if c.running and overlap(devices, c.devices)]


@dataclass(frozen=True)
class Claim:
    path: Path
    what: str  # what holds the devices, as messages name it: "generation for run demo"
    devices: Devices
    running: bool  # False: it waits for the devices


def claims(runs_dir: str | Path) -> list[Claim]:
    """The live claims, oldest first (a claim whose owner died is left out, and removed)."""
    root = queue_dir(runs_dir) / CLAIMS
    found = []
    for path in sorted(root.glob("*.json")) if root.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            owner = parse_identity(str(data["owner"]))
            devices = data["devices"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written (it is renamed in whole) or gone
        if owner is None or not pid_alive(*owner):
            path.unlink(missing_ok=True)
            continue
        found.append(Claim(path, str(data.get("what", path.stem)),
                           None if devices is None else frozenset(map(str, devices)), bool(data.get("running"))))
    return found


def _write_claim(path: Path, what: str, devices: Devices, owner: int, running: bool) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps({"what": what, "devices": None if devices is None else sorted(devices),
                               "owner": identity(owner).strip(), "running": running}), encoding="utf-8")
    os.replace(tmp, path)


def take_turn(runs_dir: str | Path, devices: Devices, what: str, start: Callable[[], int], *,
              say: Callable[[str], None] = lambda _: None, poll_s: float = 2.0, timeout_s: float = 1800.0) -> Path:
    """Wait until nothing holds `devices` (a live run, a running claim, an earlier waiting claim), then call
    `start()` under the queue's lock; it starts the process and returns its pid, which then holds the devices.
    The claim file: unlink it when that process has ended (a dead pid holds nothing anyway). `say` hears each new
    "queued ..." line; UserError after `timeout_s` of waiting."""
    root = queue_dir(runs_dir) / CLAIMS
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{time.time_ns():019d}-{os.getpid()}.json"
    _write_claim(path, what, devices, os.getpid(), running=False)  # waiting, held by this process
    deadline, said = time.monotonic() + timeout_s, ""
    try:
        while True:
            with exclusive(runs_dir):
                now = claims(runs_dir)
                earlier = [c.what for c in now if not c.running and c.path.name < path.name
                           and overlap(devices, c.devices)]
                holders = busy_runs(runs_dir, devices)
                if not holders and not earlier:
                    _write_claim(path, what, devices, start(), running=True)
                    return path
            line = f"queued: waiting for {', '.join(holders or earlier)} to end" + \
                (f" (#{len(earlier) + 1} in line, after {', '.join(earlier)})" if earlier and holders else "")
            if line != said:
                say(line)
                said = line
            if time.monotonic() > deadline:
                raise UserError(f"{', '.join(holders or earlier)} still holds the devices after "
                                f"{timeout_s / 60:.0f} minutes; try again when it has ended.")
            time.sleep(poll_s)  # a poll of the runs folder, as the queue's runner
    except BaseException:
        path.unlink(missing_ok=True)
        raise
