"""Generations started from the UI's Generate panel: `python -m trainer.engine.generate` in a process of its own
(it loads the model; torch stays out of the UI), into `<run>/generated/<id>/`, on the devices the run trained on
(its plan's: GPUs, or the CPU for the demo models). It takes them as a claim of the run queue
(trainer.core.claims): queued behind a training or another generation on the same devices, and saying what it
waits for; ahead of the queued runs; beside a training on other GPUs. It runs at a lower priority than training.
Its progress is the lines the process prints. Torch-free."""

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

from trainer.core import claims, queue
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
    """The devices a generation for this run takes: its plan's (None, every device, if it has no plan)."""
    return queue.run_devices(run_dir)


def run(runs_dir: Path, run_dir: Path, request: Request, *, say: Callable[[str], None] = lambda _: None,
        poll_s: float = 2.0, timeout_s: float = TIMEOUT_S) -> Path:
    """Generate `request` for `run_dir` once its devices are free; the folder holding base.png and tuned.png.
    `say` hears what it waits for, then the process's progress lines. UserError with the process's last line if
    it fails."""
    request = request.checked()
    out = RunFolder(run_dir).path / GENERATED / f"{time.time_ns():019d}"
    procs: list[subprocess.Popen] = []

    def start() -> int:  # under the queue's lock, once the devices are free
        out.mkdir(parents=True)
        with open(out / "generate.log", "wb") as log:
            proc = subprocess.Popen(request.argv(run_dir, out), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=repo_env(), start_new_session=True)
        procs.append(proc)
        try:
            os.setpriority(os.PRIO_PROCESS, proc.pid, 10)  # below training: a try must not slow a run
        except OSError:
            pass
        return proc.pid

    claim = claims.take_turn(runs_dir, held_devices(run_dir), f"generation for run {run_dir.name}", start, say=say,
                             poll_s=poll_s, timeout_s=timeout_s)
    proc, shown, deadline = procs[0], 0, time.monotonic() + timeout_s  # the wait above had a timeout of its own
    try:
        while True:
            try:
                code = proc.wait(timeout=poll_s)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    proc.kill()
                    proc.wait()
                    raise UserError("Generating took longer than 30 minutes and was stopped.") from None
            finally:
                shown = _say_new_lines(out / "generate.log", shown, say)
    finally:
        claim.unlink(missing_ok=True)
    if code != 0 or not (out / RESULT).is_file():
        lines = (out / "generate.log").read_text(encoding="utf-8", errors="replace").strip().splitlines()
        last = next((line for line in reversed(lines) if line.strip()), "no output")
        raise UserError(f"Generating failed: {last.removeprefix('error: ')[:400]}")
    return out


PROGRESS = "generate: "  # trainer.engine.generate.PROGRESS (the UI stays torch-free: not imported)


def _say_new_lines(log: Path, shown: int, say: Callable[[str], None]) -> int:
    """Pass on the progress lines the process printed since the first `shown` lines; how many it has printed."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").split("\n")[:-1]  # whole lines only
    except OSError:
        return shown
    for line in lines[shown:]:
        if line.startswith(PROGRESS):
            say(line.removeprefix(PROGRESS))
    return len(lines)


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
