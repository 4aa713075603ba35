"""Graceful stop: SIGTERM/SIGINT or a STOP file ends the run at the next optimizer-step boundary, after a
checkpoint. Every rank must agree on the step at which to stop, so the request travels in the per-step
all-reduce (see loop.StepStats) rather than being acted on by each rank alone."""

from __future__ import annotations

import signal
from pathlib import Path

from trainer.core.runfolder import STOP_FILE



class StopRequest:
    def __init__(self, run_dir: str | Path):
        self.stop_file = Path(run_dir) / STOP_FILE
        self.signalled: str | None = None

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signalled = signal.Signals(signum).name

    def requested(self) -> bool:
        return self.signalled is not None or self.stop_file.exists()

    def reason(self) -> str:
        return f"received {self.signalled}" if self.signalled else f"{self.stop_file.name} file"
