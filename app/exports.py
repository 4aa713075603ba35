"""Exports started from the UI: `launch.py --export RUN --step N` in a process of its own (it loads the model,
and torch stays out of the UI), its output appended to the run's train.log. Its `export` event (or, if it fails,
a `warning` event naming why) changes the run folder, so the Runs tab shows the result on its next poll."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from trainer.core.checkpoint import complete_checkpoints
from trainer.core.events import EventLog, WarningEvent
from trainer.core.launcher import repo_env
from trainer.core.outputs import export_dir, label
from trainer.core.runfolder import RunFolder, tail_lines
from trainer.errors import UserError


class Exports:
    def __init__(self) -> None:
        self._running: set[tuple[Path, int]] = set()
        self._lock = threading.Lock()

    def running(self, run_dir: Path) -> list[int]:
        with self._lock:
            return sorted(step for path, step in self._running if path == run_dir)

    def start(self, run_dir: Path, step: int) -> None:
        if step not in {c.step for c in complete_checkpoints(run_dir)}:
            raise UserError(f"Run {run_dir.name} has no complete checkpoint of step {step} (it may have been "
                            "pruned by checkpoint.keep); pick another.")
        with self._lock:
            if (run_dir, step) in self._running:
                raise UserError(f"The outputs of step {step} are being exported already.")
            self._running.add((run_dir, step))
        log_path = RunFolder(run_dir).log
        env = repo_env()
        try:
            with open(log_path, "ab") as log:
                # `-m launch`: the same command line a user types, from a checkout or an installed package
                proc = subprocess.Popen([sys.executable, "-m", "launch", "--export", str(run_dir), "--step", str(step)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        except OSError:
            with self._lock:
                self._running.discard((run_dir, step))
            raise
        threading.Thread(target=self._wait, args=(proc, run_dir, step), daemon=True,
                         name=f"export-{run_dir.name}-{step}").start()

    def _wait(self, proc: subprocess.Popen, run_dir: Path, step: int) -> None:
        try:
            if proc.wait() != 0:
                last = (tail_lines(RunFolder(run_dir).log, 1) or ["no output"])[0]
                EventLog(run_dir).emit(WarningEvent(step=step, message=(
                    f"exporting the outputs of step {step} failed (exit {proc.returncode}): {last} (see train.log)")))
        finally:
            with self._lock:
                self._running.discard((run_dir, step))


def export_files(run_dir: Path, step: int) -> list[Path]:
    """The files of step `step`'s export (downloadable: not the folders, such as a diffusers model's)."""
    folder = export_dir(run_dir, step)
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def labels_html(run_dir: Path, paths) -> str:
    """Each output file or folder, where it is and what loads it."""
    import html

    rows = "".join(f"<tr><td><code>{html.escape(str(Path(p).relative_to(run_dir)))}</code></td>"
                   f"<td>{html.escape(label(p))}</td></tr>" for p in paths)
    return (f'<table class="output-labels"><thead><tr><th>file</th><th>loads with</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>") if rows else ""
