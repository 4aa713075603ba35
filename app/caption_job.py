"""The Dataset tab's auto-captioning: `launch.py --caption FOLDER ...` in a process of its own (it loads the model:
torch stays out of the UI), one at a time, its output lines kept for the page's progress.

Everything in the command comes from the page, so it is untrusted: the folder is confined to the workspace and
passed as an absolute path; the captioner is a registry name, a plain hub id `owner/name` (whose first part is no
local path), or a model folder confined like the dataset; the rest are `--flag=value` arguments of a process
started without a shell.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from app.captions import folder_of
from trainer.captioning.files import caption_extension
from app.security import Workspace
from trainer.captioning.registry import CAPTIONERS, HUB_ID
from trainer.captioning.run import PROGRESS_PREFIX
from trainer.core.launcher import repo_env
from trainer.errors import UserError

KEPT_LINES = 200


def captioner_arg(workspace: Workspace, text: str) -> str:
    """What `--captioner` gets for the page's value (see the module's docstring)."""
    text = (text or "").strip()
    if not text or text in CAPTIONERS:
        return text or "florence2"
    if HUB_ID.match(text) and not Path(text.split("/", 1)[0]).exists():
        return text
    path = workspace.check("captioner", text)  # a path: confined like every other one
    if not path.is_dir():
        raise UserError(f"captioner: '{text}' is neither a captioner ({', '.join(CAPTIONERS)}), a model folder, nor "
                        "a hub id of the form owner/name.")
    return str(path)


@dataclass(frozen=True)
class CaptionRequest:
    folder: str
    captioner: str = "florence2"
    prefix: str = ""
    overwrite: bool = False
    instruction: str = ""
    threshold: float | None = None
    extension: str = ".txt"

    def command(self, workspace: Workspace) -> list[str]:
        folder = folder_of(workspace, self.folder)
        command = [sys.executable, "-m", "launch", "--caption", str(folder),
                   f"--captioner={captioner_arg(workspace, self.captioner)}", f"--prefix={self.prefix}",
                   f"--caption-extension={caption_extension(self.extension)}"]
        if self.instruction.strip():
            command.append(f"--instruction={self.instruction.strip()}")
        if self.threshold is not None:
            command.append(f"--threshold={float(self.threshold)}")
        return command + (["--overwrite"] if self.overwrite else [])


class CaptionJob:
    """At most one captioning process; `status()` for the page."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None  # alive until the output is read to its end and the exit seen
        self._lines: deque[str] = deque(maxlen=KEPT_LINES)
        self._lock = threading.Lock()

    def start(self, request: CaptionRequest) -> None:
        command = request.command(self.workspace)  # refused here, before anything starts
        with self._lock:
            if self.running():
                raise UserError("A captioning is running already; wait for it or stop it.")
            self._lines.clear()
            env = repo_env()
            # `-m launch`: the same command line a user types; its own session, so Stop reaches the model's process
            self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True)
            self._reader = threading.Thread(target=self._read, args=(self._proc,), daemon=True, name="caption-output")
            self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._lines.append(line.rstrip())
        proc.wait()

    def stop(self) -> None:
        """Stop the captioning: the captions written so far stay (each was written whole)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGTERM)  # launch.py and its captioning process

    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit status once the process ended and its last line was read (None: still running)."""
        if self._reader is not None:
            self._reader.join(timeout)
        return None if self._proc is None or self.running() else self._proc.returncode

    def status(self) -> str:
        """One line: the progress with its ETA while it runs, the last line (summary or error) once it ended."""
        lines = list(self._lines)
        if self._proc is None:
            return ""
        code = self._proc.returncode
        if self.running() or code is None:
            progress = next((line for line in reversed(lines) if line.startswith(PROGRESS_PREFIX)), None)
            return f"Captioning: {progress[len(PROGRESS_PREFIX):]}" if progress else \
                f"Starting: {lines[-1] if lines else 'loading the captioner'}"
        last = lines[-1] if lines else "no output"
        if code == 0:
            return f"Done: {last}"
        return f"Stopped: {last}" if code < 0 or code == 130 else f"Failed (exit {code}): {last}"
