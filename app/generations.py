"""Generations started from the UI's Generate panel: `python -m trainer.engine.generate` in a process of its own
(it loads the model; torch stays out of the UI), into `<run>/generated/<id>/`. A run trained on GPUs waits until
no live run holds those GPUs (queued behind training: two models on one GPU would each crawl or run out of memory);
a CPU run's generation starts at once, at a lower priority than any training. Torch-free."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.core import queue
from trainer.core.launcher import repo_env
from trainer.core.runfolder import RunFolder
from trainer.errors import UserError

GENERATED = "generated"
RESULT = "result.json"  # trainer.engine.generate.RESULT
TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class Request:
    step: int
    prompt: str
    seed: int = 0
    steps: int = 25
    guidance: float = 7.5
    scale: float = 1.0

    def checked(self) -> "Request":
        """The request if every value is in range; else UserError naming the value (the form is untrusted)."""
        prompt = " ".join(str(self.prompt or "").split())
        if not prompt:
            raise UserError("Type a prompt to generate.")
        if len(prompt) > 1000:
            raise UserError("The prompt is longer than 1000 characters; shorten it.")
        checks = (("seed", self.seed, 0, 2**31 - 1), ("steps", self.steps, 1, 200), ("guidance", self.guidance, 0, 30),
                  ("LoRA scale", self.scale, -2, 3))
        for name, value, low, high in checks:
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
                raise UserError(f"{name}: {value!r} is not between {low} and {high}.")
        return Request(int(self.step), prompt, int(self.seed), int(self.steps), float(self.guidance),
                       float(self.scale))

    def argv(self, run_dir: Path, out: Path) -> list[str]:
        return [sys.executable, "-m", "trainer.engine.generate", str(run_dir), "--step", str(self.step),
                "--prompt", self.prompt, "--seed", str(self.seed), "--steps", str(self.steps),
                "--guidance", str(self.guidance), "--scale", str(self.scale), "--out", str(out)]


def held_devices(run_dir: Path) -> queue.Devices:
    """The devices a generation for this run would use: its plan's (a CPU run's: none to wait for)."""
    devices = queue.run_devices(run_dir)
    return frozenset() if devices == frozenset({"cpu"}) else devices


def run(runs_dir: Path, run_dir: Path, request: Request, *, say: Callable[[str], None] = lambda _: None,
        poll_s: float = 2.0, timeout_s: float = TIMEOUT_S) -> Path:
    """Generate `request` for `run_dir` (waiting for its devices first); the folder holding base.png and
    tuned.png. UserError with the process's last line if it fails."""
    request = request.checked()
    devices = held_devices(run_dir)
    deadline = time.monotonic() + timeout_s
    while devices != frozenset() and (busy := queue.busy_runs(runs_dir, devices)):
        say(f"waiting for {', '.join(busy)} to free the GPU")
        if time.monotonic() > deadline:
            raise UserError(f"{', '.join(busy)} still holds the GPU; generate again when it has ended.")
        time.sleep(poll_s)  # a poll of the runs folder, as the queue's runner
    out = RunFolder(run_dir).path / GENERATED / f"{time.time_ns():019d}"
    out.mkdir(parents=True)
    env = repo_env()
    with open(out / "generate.log", "wb") as log:
        proc = subprocess.Popen(request.argv(run_dir, out), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, 10)  # below training: a try must not slow a run
        except OSError:
            pass
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise UserError("Generating took longer than 30 minutes and was stopped.") from None
    if code != 0 or not (out / RESULT).is_file():
        lines = (out / "generate.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
        last = next((line for line in reversed(lines) if line.strip()), "no output")
        raise UserError(f"Generating failed: {last.removeprefix('error: ')[:400]}")
    return out


def result_of(out: Path) -> dict:
    return json.loads((out / RESULT).read_text(encoding="utf-8"))


class Generations:
    """At most one generation per run at a time (a second press while one runs is refused)."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self._running: set[Path] = set()
        self._lock = threading.Lock()

    def run(self, run_dir: Path, request: Request, say: Callable[[str], None] = lambda _: None) -> Path:
        with self._lock:
            if run_dir in self._running:
                raise UserError(f"{run_dir.name} is generating already; wait for its images.")
            self._running.add(run_dir)
        try:
            return run(self.runs_dir, run_dir, request, say=say)
        finally:
            with self._lock:
                self._running.discard(run_dir)
