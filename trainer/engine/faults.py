"""Test-only fault switch for the real worker: IMAGETUNE_FAULT puts a stop, a crash or a hang at an exact
optimizer step (or slows one rank's input), so the stop/kill/resume tests prove their point on any machine instead of racing a timer
against the speed of the run.

    IMAGETUNE_FAULT="stop_at_step=2"           every rank finds the STOP file at step 2: the run checkpoints
                                               step 2 and ends `stopped`, through the product's own stop path
    IMAGETUNE_FAULT="kill_rank=1,at_step=2"    global rank 1 SIGKILLs itself as step 2 ends, before anything
                                               of step 2 (progress on rank 0 aside) is sampled or checkpointed
    IMAGETUNE_FAULT="hang_rank=1,at_step=2"    global rank 1 stops answering as step 2 ends (the others time
                                               out after distributed.timeout_s)
    IMAGETUNE_FAULT="slow_rank=1"              global rank 1's input takes SLOW_INPUT_S longer for every
                                               micro-batch (a slow disk): the telemetry names it, the maths
                                               does not change

Users never set it; absent, it costs two no-op calls per step. A value that does not parse fails the run
before its first step, loudly: a misspelt switch must not quietly test the happy path instead.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "IMAGETUNE_FAULT"
SLOW_INPUT_S = 0.25


@dataclass(frozen=True)
class Fault:
    stop_at_step: int | None = None
    kill_rank: int | None = None
    hang_rank: int | None = None
    at_step: int | None = None
    slow_rank: int | None = None

    def slow_input(self, rank: int) -> None:
        """Called as the loop asks for a micro-batch: the slow rank's input is late by SLOW_INPUT_S."""
        if rank == self.slow_rank:
            time.sleep(SLOW_INPUT_S)

    def before_vote(self, stop_file: Path, step: int) -> None:
        """Called as `step` (1-based) is about to agree on stopping: the STOP file appears, on every rank, so
        the stop is exactly the one a user's STOP makes, decided at this step."""
        if step == self.stop_at_step:
            stop_file.touch()

    def step_ended(self, rank: int, step: int) -> None:
        if step != self.at_step:
            return
        if rank == self.kill_rank:
            print(f"{ENV}: rank {rank} kills itself (SIGKILL) after step {step}", flush=True)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == self.hang_rank:
            print(f"{ENV}: rank {rank} hangs after step {step}", flush=True)
            while True:  # until the launcher or the test kills it
                time.sleep(60)


NO_FAULT = Fault()


def parse(text: str) -> Fault:
    """"key=N,key=N" -> Fault; raises ValueError naming the problem for anything else."""
    fields: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in Fault.__dataclass_fields__ or key in fields:
            raise ValueError(f"{ENV}={text!r}: {part!r} is not one of stop_at_step=N, kill_rank=R, hang_rank=R, "
                             f"at_step=N, slow_rank=R (each once)")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"{ENV}={text!r}: {key} needs a whole number, not {value.strip()!r}") from None
        if fields[key] < (1 if key.endswith("step") else 0):
            raise ValueError(f"{ENV}={text!r}: {key}={fields[key]} is out of range (steps count from 1)")
    fault = Fault(**fields)
    crash = fault.kill_rank is not None or fault.hang_rank is not None
    if not fields:
        raise ValueError(f"{ENV} is set but empty: unset it, or name a fault (see trainer/engine/faults.py)")
    if crash != (fault.at_step is not None) or (fault.kill_rank is not None and fault.hang_rank is not None):
        raise ValueError(f"{ENV}={text!r}: kill_rank or hang_rank (one of them) goes with at_step=N")
    return fault


def from_env(environ=os.environ) -> Fault:
    text = environ.get(ENV)
    return NO_FAULT if text is None else parse(text)
