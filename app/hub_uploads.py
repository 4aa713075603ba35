"""Hub uploads started from the UI: `launch.py --push-to-hub RUN REPO` in a process of its own (huggingface_hub
with this machine's HF_TOKEN), its output appended to the run's train.log. A done run only, and only on a UI that
is not reachable from other machines: uploading with the owner's token is a command-line feature there, as
`output.push_to_hub` in a form is (app.security.upload_problems)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from trainer.core.config import load_config
from trainer.core.events import EventLog, WarningEvent, final_event, read_events
from trainer.core.launcher import repo_env
from trainer.core.runfolder import RunFolder, tail_lines
from trainer.errors import ConfigError, UserError

EXPOSED = ("Uploading with this machine's Hugging Face token is a command-line feature when the UI is reachable "
           "from other machines: python launch.py --push-to-hub runs/<name> user/name")


class HubUploads:
    def __init__(self) -> None:
        self._status: dict[Path, tuple[str, str]] = {}  # run folder -> (state: uploading/ok/error, what to say)
        self._lock = threading.Lock()

    def status(self, run_dir: Path) -> tuple[str, str] | None:
        with self._lock:
            return self._status.get(run_dir)

    def start(self, run_dir: Path, repo: str, *, exposed: bool) -> subprocess.Popen:
        if exposed:
            raise UserError(EXPOSED)
        final = final_event(read_events(run_dir))
        if final is None or final["type"] != "done":
            raise UserError(f"Run {run_dir.name} has not finished: only a done run's outputs are uploaded (export a "
                            "checkpoint to try it first).")
        repo = (repo or "").strip()
        try:  # the repo id and the token, checked as a preset's output.push_to_hub is, before a process starts
            load_config(RunFolder(run_dir).config, [f"output.push_to_hub={repo}"], check_paths=False)
        except ConfigError as exc:
            raise UserError(str(exc)) from None
        with self._lock:
            if self._status.get(run_dir, ("",))[0] == "uploading":
                raise UserError(f"Run {run_dir.name} is being uploaded already.")
            self._status[run_dir] = ("uploading", f"Uploading the outputs to {repo} (its lines are in the log).")
        env = repo_env()
        try:
            with open(RunFolder(run_dir).log, "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", "launch", "--push-to-hub", str(run_dir), repo],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        except OSError as exc:
            with self._lock:
                self._status[run_dir] = ("error", f"The upload did not start: {exc}")
            raise
        threading.Thread(target=self._wait, args=(proc, run_dir, repo), daemon=True,
                         name=f"hub-{run_dir.name}").start()
        return proc

    def _wait(self, proc: subprocess.Popen, run_dir: Path, repo: str) -> None:
        code = proc.wait()
        last = (tail_lines(RunFolder(run_dir).log, 1) or ["no output"])[0]
        if code == 0:
            state = ("ok", last)  # "uploaded: <the repo's URL>"
        else:
            state = ("error", f"Uploading to {repo} failed: {last}")
            EventLog(run_dir).emit(WarningEvent(message=f"{state[1]} (see train.log)"))
        with self._lock:
            self._status[run_dir] = state
