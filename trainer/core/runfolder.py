"""The run folder, the one contract between the trainer and every front-end: `RunFolder` knows every file in
it, and whether the run is alive. Torch-free (the web UI reads run folders through it).

    runs/<name>/
      config.yaml      the fully resolved config          plan.json     the plan (the workers read it)
      events.jsonl     append-only events (rank 0)        train.log     everything the processes printed
      launcher.pid     the run's process and its start time: torchrun (a one-process run: its worker)
      logs/            torchrun's per-rank logs (a one-process run, started without torchrun, has none)
      run.lock         the launch that owns the folder (trainer.core.runlock)
      samples/         step-NNNNNN-pKK.png                checkpoints/  step-NNNNNN/ (COMPLETE when whole), best/
      output/          the final artifacts                STOP          a front-end's request for a graceful stop
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.core.runlock import LOCK_FILE, recorded_pid, write_identity
from trainer.errors import UserError

CONFIG_FILE = "config.yaml"
PLAN_FILE = "plan.json"
EVENTS_FILE = "events.jsonl"
LOG_FILE = "train.log"
PID_FILE = "launcher.pid"
LOGS_DIR = "logs"
STOP_FILE = "STOP"
KILL_FILE = "KILLED"  # Kill was asked for by another process: the launcher's ending says so
SAMPLES_DIR = "samples"
CHECKPOINTS_DIR = "checkpoints"
OUTPUT_DIR = "output"
BEST = "best"  # checkpoints/best/: the weights of the best evaluation so far (never pruned, never resumed from)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


@dataclass(frozen=True)
class RunFolder:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return self.path.name

    config = property(lambda self: self.path / CONFIG_FILE)
    plan = property(lambda self: self.path / PLAN_FILE)
    events = property(lambda self: self.path / EVENTS_FILE)
    log = property(lambda self: self.path / LOG_FILE)
    pid_file = property(lambda self: self.path / PID_FILE)
    logs = property(lambda self: self.path / LOGS_DIR)
    stop_file = property(lambda self: self.path / STOP_FILE)
    kill_file = property(lambda self: self.path / KILL_FILE)
    samples = property(lambda self: self.path / SAMPLES_DIR)
    checkpoints = property(lambda self: self.path / CHECKPOINTS_DIR)
    output = property(lambda self: self.path / OUTPUT_DIR)
    best = property(lambda self: self.path / CHECKPOINTS_DIR / BEST)

    def sample(self, step: int, index: int) -> Path:
        return self.samples / f"step-{step:06d}-p{index:02d}.png"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:06d}"

    def read_plan(self) -> dict:
        return json.loads(self.plan.read_text(encoding="utf-8"))

    def request_stop(self) -> Path:
        """Ask the workers for a graceful stop (checkpoint, then `stopped`)."""
        self.stop_file.touch()
        return self.stop_file

    # ---- the launcher's process (identities with start times: trainer.core.runlock) -------------------------
    lock = property(lambda self: self.path / LOCK_FILE)

    def record_launcher(self, pid: int) -> None:
        """launcher.pid: torchrun's pid (a one-process run's: its worker's) and its start time, so that a pid
        reused after a reboot or a container restart is never taken for the run (nor signalled)."""
        write_identity(self.pid_file, pid)

    def launcher_pid(self) -> int | None:
        """torchrun's (or the one worker's) pid if that very process still runs (the start time matches), else None."""
        return recorded_pid(self.pid_file)

    def is_alive(self) -> bool:
        """Whether the process that runs this run (torchrun and so its workers, or the one worker) still runs."""
        return self.launcher_pid() is not None


def check_run_name(name: str) -> None:
    # The name becomes a folder (and torchrun's rendezvous id), so slashes, `..`, spaces or a trailing newline
    # must not get through: the whole string must match.
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserError(
            f"Run name {name!r} cannot be used as a folder name. Use letters, digits, '.', '_' and '-' "
            "(starting with a letter or digit), for example name=my-dog-lora."
        )


def create_run_dir(runs_dir: str | Path, name: str) -> Path:
    """Create `runs_dir/name`, or `name-2`, `name-3`... if taken. Never reuses an existing folder.

    `mkdir(exist_ok=False)` is the atomic claim: two launches racing for the same name get different folders.
    """
    check_run_name(name)
    runs_dir = Path(runs_dir).expanduser().resolve()
    try:
        runs_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"Cannot create the runs folder '{runs_dir}': {exc.strerror}. Pick another with --runs-dir.") from None
    for n in range(1, 10_000):
        candidate = runs_dir / (name if n == 1 else f"{name}-{n}")
        try:
            candidate.mkdir(exist_ok=False)
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"Cannot create the run folder '{candidate}': {exc.strerror}.") from None
        return candidate
    raise UserError(f"Too many runs named '{name}' in {runs_dir}; choose another name (name=...).")


def write_atomic(path: Path, text: str) -> None:
    """Write through a temporary file and rename, so a reader (the UI) never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def read_plan(run_dir: str | Path) -> dict:
    return RunFolder(Path(run_dir)).read_plan()


def request_stop(run_dir: str | Path) -> Path:
    """Ask the workers for a graceful stop (checkpoint, then `stopped`)."""
    return RunFolder(Path(run_dir)).request_stop()


def tail_lines(path: Path, count: int = 20, max_bytes: int = 64_000) -> list[str]:
    """The last `count` non-empty lines of a (possibly large) text file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = [line.rstrip() for line in data.decode("utf-8", "replace").splitlines()]
    return [line for line in lines if line.strip()][-count:]


def rank_log_files(run_dir: str | Path, local_rank: int) -> list[Path]:
    """This launch's log files of one local rank: `logs/<rdzv id>_<random>/attempt_<n>/<local_rank>/std*.log`.

    Every launch (a resume is a new launch) gets a new `<rdzv id>_<random>` folder; the newest is this one.
    """
    root = Path(run_dir) / LOGS_DIR
    if not root.is_dir():
        return []
    launches = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not launches:
        return []
    attempts = sorted(launches[-1].glob("attempt_*"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return []
    folder = attempts[-1] / str(local_rank)
    return [p for p in (folder / "stderr.log", folder / "stdout.log") if p.is_file()]
