"""What torchrun says when a rank dies, turned into the `failed` event a person can act on: which rank died
first and how (from torchrun's summary in this launch's part of train.log) and that rank's last log lines. A
one-process run has no torchrun (trainer.core.launcher.single_process): its one rank is the process the launcher
waited for, so its exit status is the root cause, and its last lines are this launch's end of train.log."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path

from trainer.core.runfolder import LOG_FILE, rank_log_files, tail_lines


@dataclass(frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int


# torchrun's summary: "Failures:" (the other ranks, or <NO_OTHER_FAILURES>), then "Root Cause (first observed
# failure):", each entry with "rank : 1 (local_rank: 1)" and "exitcode : -9 (pid: 123)".
_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*exitcode\s*:\s*(-?\d+)")
_ROOT_HEADER = "Root Cause (first observed failure):"
# Signals that end a rank from outside or by a crash of its own; a peer's death never causes them. A rank whose
# peer died exits with an error (gloo: "Connection closed by peer", code 1) or, tearing down, SIGABRT.
_FIRST_HAND = (-signal.SIGKILL, -signal.SIGSEGV, -signal.SIGBUS, -signal.SIGILL, -signal.SIGFPE)


def parse_root_cause(text: str) -> RankFailure | None:
    """The rank that failed first, from the last torchrun summary in `text`.

    torchrun's own "Root Cause" is the failure with the earliest timestamp, but its timestamps are whole seconds
    (torch.distributed.elastic ProcessFailure): when rank 1 is SIGKILLed (the OOM killer) and rank 0 then exits
    with "Connection closed by peer" within the same second, the tie goes to rank 0 and the summary blames the
    survivor (seen on CI: "Rank 0 exited with code 1" for a run whose rank 1 was killed). So a rank killed by a
    first-hand signal (_FIRST_HAND) is the root cause whatever torchrun put first."""
    at = text.rfind(_ROOT_HEADER)
    if at < 0:
        return None
    start = text.rfind("Failures:", 0, at)
    previous = text.rfind(_ROOT_HEADER, 0, at)
    others = text[start:at] if start > previous else ""
    root = _ENTRY.search(text, at)
    if root is None:
        return None
    failures = [RankFailure(*map(int, m.groups())) for m in _ENTRY.finditer(others)]
    torchruns_choice = RankFailure(*map(int, root.groups()))
    if torchruns_choice.exitcode in _FIRST_HAND:
        return torchruns_choice
    return next((f for f in failures if f.exitcode in _FIRST_HAND), torchruns_choice)


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


def _exit_advice(exitcode: int) -> str:
    """What a user can do about an exit code, in a sentence."""
    if exitcode == -signal.SIGKILL:
        return (
            "SIGKILL usually means the system ran out of memory (see `dmesg`): lower batch.per_device or "
            "data.resolution, enable train.gradient_checkpointing, or use fewer processes."
        )
    if exitcode in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP):
        return "Something outside the run stopped it (a kill, a logout, a job scheduler); resume it with --resume."
    return "Its last log lines below show the error; fix what they name, then resume with --resume or start again."


def describe_failure(run_dir: str | Path, returncode: int, log_offset: int = 0, node_rank: int = 0,
                     single_process: bool = False) -> dict:
    """The fields of the `failed` event for a torchrun that exited without a final event: which rank died
    and how (from torchrun's summary in this launch's part of train.log), and that rank's last log lines.
    `single_process`: the process that exited was the run's one worker (rank 0), started without torchrun."""
    run_dir = Path(run_dir)
    where, lines = LOG_FILE, []
    if single_process:
        # The worker wrote straight into train.log: this launch's part ends with its last lines.
        cause = RankFailure(rank=0, local_rank=0, exitcode=returncode) if returncode != 0 else None
        lines = [line.rstrip() for line in _read_from(run_dir / LOG_FILE, log_offset, 64_000).splitlines()
                 if line.strip()]
        if lines and lines[0].startswith("$ "):
            lines = lines[1:]  # the launcher's command line
        lines = lines[-20:]
    else:
        cause = parse_root_cause(_read_from(run_dir / LOG_FILE, log_offset))
        if cause is not None:
            for path in rank_log_files(run_dir, cause.local_rank):  # stderr first: that is where tracebacks go
                where, lines = str(path.relative_to(run_dir)), tail_lines(path)
                if lines:
                    break
            if not lines:  # no per-rank file (torchrun failed early): the rank's lines tee'd into train.log
                where = LOG_FILE
                prefix = f"[rank{cause.rank}]"
                lines = [line for line in tail_lines(run_dir / LOG_FILE, 400) if line.startswith(prefix)][-20:]
    if cause is not None:
        reason = (
            f"Rank {cause.rank} (local rank {cause.local_rank} on node {node_rank}) {_describe_exit(cause.exitcode)}."
            f" {_exit_advice(cause.exitcode)} Last lines of {where}:\n" + "\n".join(lines or ["(it printed nothing)"])
        )
        return {"reason": reason, "rank": cause.rank, "exitcode": cause.exitcode, "log": where}
    if returncode == 0:
        head = "The workers exited without reporting how the run ended (no done/stopped event); this is a bug."
    else:
        head = (
            f"torchrun {_describe_exit(returncode)} before any worker reported an error. {_exit_advice(returncode)}"
            " For a multi-node run, check that every node started and can reach distributed.master_addr:port."
        )
    lines = tail_lines(run_dir / LOG_FILE)
    return {"reason": f"{head} Last lines of {LOG_FILE}:\n" + "\n".join(lines), "exitcode": returncode}


def _read_from(path: Path, offset: int, max_bytes: int = 2_000_000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, os.path.getsize(path) - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
