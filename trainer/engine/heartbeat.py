"""Each rank's heartbeat file, read by its node's launcher to catch a stalled rank (trainer.core.stall).

`heartbeats/rank-<global rank>.json` holds {"rank", "pid", "step", "phase", "alive", "stepped"}: `stepped` is when
the rank last finished an optimizer step (the loop calls `stepped()`), `alive` is when a daemon thread last wrote
the file, every 2 s. A SIGSTOPped or wedged process refreshes neither; a rank waiting in a collective for a frozen peer
stays alive but stops stepping. So the launcher can tell the rank that froze from the ranks that wait for it.
Writes are atomic (a temporary file renamed), a few hundred bytes each.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.core.stall import HEARTBEAT_DIR, HEARTBEAT_INTERVAL_S



class Heartbeat:
    def __init__(self, run_dir: str | Path, rank: int, phase: Callable[[], str],
                 interval_s: float = HEARTBEAT_INTERVAL_S):
        self.path = Path(run_dir) / HEARTBEAT_DIR / f"rank-{rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank, self.phase, self.interval_s = rank, phase, interval_s
        self.step, self.stepped_at = 0, time.time()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True, name="heartbeat")

    def start(self, step: int) -> Heartbeat:
        self.step, self.stepped_at = step, time.time()
        self._write()
        self._thread.start()
        return self

    def stepped(self, step: int) -> None:
        """An optimizer step ended (called by the loop). Only remembered: the refresher thread writes it within
        2 s, which is all the launcher's resolution needs, and the step's hot path does no file I/O."""
        self.step, self.stepped_at = step, time.time()

    def stop(self) -> None:
        self._stop.set()

    def _refresh(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def _write(self) -> None:
        beat = {"rank": self.rank, "pid": os.getpid(), "step": self.step, "phase": self.phase(),
                "alive": round(time.time(), 3), "stepped": round(self.stepped_at, 3)}
        with self._lock:  # the loop and the refresher thread
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            try:
                tmp.write_text(json.dumps(beat))
                os.replace(tmp, self.path)
            except OSError:
                pass  # a full disk must not kill training; the launcher then sees an old beat and says so
