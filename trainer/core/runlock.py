"""Who owns a run folder: the launcher's pid file with the process's start time, and the per-run lock.

A bare PID is not an identity: after a reboot or a container restart the number is handed to an unrelated
process, and a run that ended would then look alive for good (and Kill would signal a stranger's process group).
So a PID is stored with the kernel's start time of that process (/proc/<pid>/stat field 22) and both must match.
Old pid files hold only the PID; they are still read, with the weaker check.

The lock (`run.lock`, created with O_EXCL) makes one launch at a time own a run folder, from preparing it to the
end of its workers, so two Resume clicks (or two UIs on one runs folder) cannot train into the same folder. It
holds the owner's identity in the same form, so a lock whose owner is gone is taken over rather than blocking
the run forever. Torch-free.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from trainer.errors import UserError

LOCK_FILE = "run.lock"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None (no such process, or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return None
    try:
        # Fields after `(comm)`, which may hold spaces and parentheses: state is field 3, starttime field 22.
        return int(text.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def identity(pid: int) -> str:
    started = start_time(pid)
    return f"{pid} {started}\n" if started is not None else f"{pid}\n"


def parse_identity(text: str) -> tuple[int, int | None] | None:
    parts = text.split()
    try:
        return int(parts[0]), (int(parts[1]) if len(parts) > 1 else None)
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether `pid` runs and, when its start time is known, is the same process that was recorded."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:
        pass  # it exists, owned by another user (a run started as root, a UI running as a user): alive
    except OSError:
        return False
    if started is None:
        return True
    now = start_time(pid)
    return now is None or now == started  # no /proc to ask: trust kill(0)


def recorded_pid(path: str | Path) -> int | None:
    """The PID in a pid/lock file if that very process still runs, else None."""
    try:
        found = parse_identity(Path(path).read_text())
    except OSError:
        return None
    if found is None or not pid_alive(*found):
        return None
    return found[0]


def write_identity(path: Path, pid: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(identity(pid), encoding="utf-8")
    os.replace(tmp, path)


def release_lock(run_dir: str | Path, owner: int) -> None:
    """Remove the run's lock if `owner` holds it (a later launch may own it by now)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        found = parse_identity(path.read_text())
    except OSError:
        return
    if found is not None and found[0] == owner:
        path.unlink(missing_ok=True)


class RunLock:
    """`with RunLock(run_dir):` or acquire()/release(); `hand_over(pid)` makes another process (torchrun) the owner,
    so the lock stays held for as long as the workers run, even if this launcher goes away."""

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> RunLock:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                owner = recorded_pid(self.path)
                if owner is None:
                    owner = self._remove_stale()
                if owner is not None:  # another thread of this process counts too: two Resume clicks in one UI
                    raise UserError(
                        f"Run {self.path.parent.name} is already being started or trained by process {owner} "
                        f"({self.path}); wait for it to finish or stop it, then try again.") from None
                continue
            except OSError as exc:
                raise UserError(f"Cannot lock the run folder {self.path.parent}: {exc.strerror}.") from None
            with os.fdopen(fd, "w") as f:
                f.write(identity(os.getpid()))
            self.held = True
            return self
        raise UserError(f"Could not take the lock {self.path}; another launch keeps taking it. Try again.")

    def _remove_stale(self) -> int | None:
        """Move a dead owner's lock aside; None when done, else the live owner found in what was moved (another
        launcher replaced the stale lock between our read and our rename: its lock is put back)."""
        aside = self.path.with_name(f".{LOCK_FILE}.stale-{os.getpid()}-{id(self)}")
        try:
            os.rename(self.path, aside)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return None
        owner = recorded_pid(aside)
        if owner is not None:
            try:
                os.link(aside, self.path)
            except OSError:
                pass  # a third launcher got in first; it holds the lock now
        aside.unlink(missing_ok=True)
        return owner

    def hand_over(self, pid: int) -> None:
        if self.held:
            write_identity(self.path, pid)

    def release(self) -> None:
        if self.held:
            self.held = False
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
