"""Catching a stalled rank from its node's launcher (torch-free), through the heartbeats the workers leave
(trainer.engine.heartbeat).

Measured before this existed: with one of two CPU ranks frozen (SIGSTOP) the run wrote nothing for 90 s and
would have hung until the 1800 s collective timeout, shown as "running" all along. Now, after
`distributed.stall_warning_s` without a step (unset: 20 step times, at least a minute) a `warning` names the
silent ranks, and after `distributed.stall_timeout_s` the launcher ends the run `failed`, naming them and the
last checkpoint. A rank is *frozen* when its process stopped refreshing its heartbeat (SIGSTOP, a wedged driver
call); a rank whose heartbeat is fresh but which finishes no step while training *waits* (for the frozen one, or
in a deadlock when none is frozen). Ranks busy outside the steps (samples, evaluation, checkpoints: their phase
says so) are not counted as stalled while they are alive.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

HEARTBEAT_DIR = "heartbeats"  # trainer.engine.heartbeat writes here
HEARTBEAT_INTERVAL_S = 2.0  # how often a rank's heartbeat file is rewritten
FROZEN_AFTER_S = 5 * HEARTBEAT_INTERVAL_S  # a heartbeat older than this: its process is not running
MIN_WARNING_S = 60.0
STEP_TIMES_FOR_WARNING = 20

# How a stall warning begins: the Runs page shows one only until the run steps again or ends (app.runs).
STALL_PREFIX = "No step for "


@dataclass(frozen=True)
class Beat:
    rank: int
    pid: int
    step: int
    phase: str
    alive: float
    stepped: float

    @property
    def training(self) -> bool:
        return self.phase.startswith("step ")


def read_beats(run_dir: str | Path) -> dict[int, Beat]:
    beats = {}
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank-*.json"):
        try:
            data = json.loads(path.read_text())
            beat = Beat(int(data["rank"]), int(data["pid"]), int(data["step"]), str(data["phase"]),
                        float(data["alive"]), float(data["stepped"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not ours
        beats[beat.rank] = beat
    return beats


@dataclass
class StallWatch:
    run_dir: Path
    ranks: tuple[int, ...]  # this node's global ranks
    warning_s: float | None = None  # None: from the measured step time
    timeout_s: float = 900.0  # 0: never end the run
    since: float = field(default_factory=time.time)  # beats older than this are a previous launch's
    warned: bool = False
    _last_step: dict[int, tuple[int, float]] = field(default_factory=dict)
    _step_times: list[float] = field(default_factory=list)

    def warning_after(self) -> float:
        if self.warning_s is not None:
            return self.warning_s
        if not self._step_times:
            return MIN_WARNING_S
        return max(MIN_WARNING_S, STEP_TIMES_FOR_WARNING * statistics.median(self._step_times[-50:]))

    def check(self, now: float) -> tuple[str | None, str | None]:
        """(a warning to emit, or None; the reason to end the run with, or None) at time `now`."""
        # A resumed run's folder still holds the last launch's beats: they say nothing about this one.
        beats = {r: b for r, b in read_beats(self.run_dir).items() if b.alive >= self.since}
        if not beats:
            return None, None  # still setting up: loading models and caches may take long
        self._learn_step_times(beats)
        frozen = {r: now - b.alive for r, b in beats.items() if now - b.alive > FROZEN_AFTER_S}
        missing = [r for r in self.ranks if r not in beats]
        waiting = {r: now - b.stepped for r, b in beats.items() if b.training and r not in frozen}
        first_alive = min(b.alive for b in beats.values())
        ages = [*frozen.values(), *([now - first_alive] if missing else []), *waiting.values()]
        stall = max(ages, default=0.0)
        if stall <= self.warning_after():
            self.warned = False
            return None, None
        message = self._describe(beats, frozen, missing, waiting, stall)
        if self.timeout_s and stall > self.timeout_s:
            return None, message + f" The launcher ended the run after distributed.stall_timeout_s={self.timeout_s:g} s."
        if self.warned:
            return None, None
        self.warned = True
        return message + (f" The run is ended at distributed.stall_timeout_s={self.timeout_s:g} s unless it moves."
                          if self.timeout_s else ""), None

    def _learn_step_times(self, beats: dict[int, Beat]) -> None:
        for rank, beat in beats.items():
            step, stepped = self._last_step.get(rank, (beat.step, beat.stepped))
            if beat.step > step and beat.stepped > stepped:
                self._step_times.append((beat.stepped - stepped) / (beat.step - step))
            self._last_step[rank] = (beat.step, beat.stepped)

    def _describe(self, beats, frozen, missing, waiting, stall: float) -> str:
        parts = []
        if frozen:
            parts.append("frozen (their process stopped answering): " + ", ".join(
                f"rank {r} (pid {beats[r].pid}, at {beats[r].phase}, last step {beats[r].step}, silent "
                f"{age:.0f} s)" for r, age in sorted(frozen.items())))
        if missing:
            parts.append("never reported a step: " + ", ".join(f"rank {r}" for r in missing))
        if waiting:
            who = "waiting for them" if frozen or missing else "alive but finishing no step (a deadlock?)"
            parts.append(f"{who}: " + ", ".join(f"rank {r} (at {beats[r].phase}, last step {beats[r].step})"
                                                for r in sorted(waiting)))
        return f"{STALL_PREFIX}{stall:.0f} s. " + "; ".join(parts) + "."
