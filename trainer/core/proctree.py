"""Killing a run for good: torchrun and every worker it started (or a one-process run's worker and its children).

`killpg` on torchrun's process group is not enough: torchrun starts each worker in a session of its own, so a
SIGKILLed torchrun leaves its workers running (and writing events after the run was declared failed). We
collect the process tree while torchrun is alive, and kill each member's group, checking each pid's start time
first so that a pid the system has since reused is never signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import defaultdict

Identity = tuple[int, str]  # (pid, start time): a pid alone may be reused once the process is gone


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, start time) of every process."""
    table: dict[int, tuple[int, str, str]] = {}
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    data = f.read()
            except OSError:
                continue
            fields = data[data.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
            table[int(entry)] = (int(fields[1]), fields[0], fields[19])  # ppid, state, starttime
        return table
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,state=,lstart="], capture_output=True, text=True).stdout
    for line in out.splitlines():  # macOS and friends
        parts = line.split(None, 3)
        if len(parts) == 4:
            table[int(parts[0])] = (int(parts[1]), parts[2][:1], parts[3])
    return table


def descendants(pid: int) -> set[Identity]:
    table = _table()
    children: dict[int, list[int]] = defaultdict(list)
    for child, (parent, _, _) in table.items():
        children[parent].append(child)
    found: set[Identity] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.add((child, table[child][2]))
            stack.append(child)
    return found


def _alive(members: set[Identity]) -> set[Identity]:
    table = _table()
    # A zombie is dead for our purposes: it only waits for a parent (maybe init) to collect its exit code.
    return {(pid, start) for pid, start in members if pid in table and table[pid][2] == start and table[pid][1] != "Z"}


def _signal(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:  # a group leader (torchrun's workers are): reach its own children too
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int, grace_s: float = 10.0, process: subprocess.Popen | None = None) -> None:
    """SIGTERM `pid`'s group (torchrun passes it on, so workers may still stop gracefully), then SIGKILL
    everything of the tree still alive after grace_s. `process`, if given, is reaped as it exits."""
    tree = descendants(pid)
    _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while True:
        root_alive = process.poll() is None if process is not None else bool(_alive({(pid, _start(pid))}))
        if root_alive:
            tree |= descendants(pid)  # workers that were still being started
        if not root_alive and not _alive(tree):
            return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if root_alive:
        _signal(pid, signal.SIGKILL)
    for member, _ in _alive(tree):
        _signal(member, signal.SIGKILL)
    if process is not None:
        process.wait()
    # SIGKILL lands asynchronously: return once nothing of the tree runs, so no event can follow our `failed`.
    deadline = time.monotonic() + 5
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.02)


def ended(pid: int) -> bool:
    """Whether `pid` no longer runs (a zombie, waiting for its parent to collect it, has ended)."""
    return not _alive({(pid, _start(pid))})


def _start(pid: int) -> str:
    entry = _table().get(pid)
    return entry[2] if entry else ""
