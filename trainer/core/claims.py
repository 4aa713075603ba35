"""Claims: short jobs outside the run queue that take devices by its rules (trainer.core.queue), so that they never
share a GPU with a training (two models on one GPU would each crawl or run out of memory) nor the CPU's cores with a
CPU training (on 2 cores two at once ran at a tenth of one's speed). The web UI's Generate is one. Torch-free.

    runs/.queue/.claims/<ns>-<pid>.json   {what, devices, owner (pid and start time), running}

A claim waits while a live run, a running claim or an earlier waiting claim holds one of its devices (a
generation on GPU 1 does not wait for a run on GPU 0), then starts its process under the queue's lock and holds
the devices until that process ends: queued runs wait for it as for a run. A waiting claim goes before the queued
runs (the queue's start_next lets it): it is a minute's work that someone is watching, a queued run is hours that
nobody is. A claim whose owner died (the UI that waited, or the process it started) holds nothing; each file is
written whole (a rename), as the queue's entries.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.core import queue
from trainer.core.runlock import identity, parse_identity, pid_alive
from trainer.errors import UserError

CLAIMS = ".claims"


@dataclass(frozen=True)
class Claim:
    path: Path
    what: str  # what holds the devices, as messages name it: "generation for run demo"
    devices: queue.Devices
    running: bool  # False: it waits for the devices


def claims(runs_dir: str | Path) -> list[Claim]:
    """The live claims, oldest first (a claim whose owner died is left out, and removed)."""
    root = queue.queue_dir(runs_dir) / CLAIMS
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


def _write_claim(path: Path, what: str, devices: queue.Devices, owner: int, running: bool) -> None:
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps({"what": what, "devices": None if devices is None else sorted(devices),
                               "owner": identity(owner).strip(), "running": running}), encoding="utf-8")
    os.replace(tmp, path)


def take_turn(runs_dir: str | Path, devices: queue.Devices, what: str, start: Callable[[], int], *,
              say: Callable[[str], None] = lambda _: None, poll_s: float = 2.0, timeout_s: float = 1800.0) -> Path:
    """Wait until nothing holds `devices` (a live run, a running claim, an earlier waiting claim), then call
    `start()` under the queue's lock; it starts the process and returns its pid, which then holds the devices.
    The claim file: unlink it when that process has ended (a dead pid holds nothing anyway). `say` hears each new
    "queued ..." line; UserError after `timeout_s` of waiting."""
    root = queue.queue_dir(runs_dir) / CLAIMS
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{time.time_ns():019d}-{os.getpid()}.json"
    _write_claim(path, what, devices, os.getpid(), running=False)  # waiting, held by this process
    deadline, said = time.monotonic() + timeout_s, ""
    try:
        while True:
            with queue.exclusive(runs_dir):
                now = claims(runs_dir)
                earlier = [c.what for c in now if not c.running and c.path.name < path.name
                           and queue.overlap(devices, c.devices)]
                holders = queue.busy_runs(runs_dir, devices)
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
