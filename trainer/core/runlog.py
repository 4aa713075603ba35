"""train.log for people: each event that matters as one timestamped line, beside what the processes print.

The workers' rank 0 prints these lines (its stdout is train.log, through the launcher); the launcher appends its
own (the plan, a resume, a stall warning, a failure it diagnoses) to the file directly. events.jsonl stays the
contract for programs; this is what someone reads in `tail -f train.log` or in the UI's log box. Torch-free.

Progress gets a line every `progress_every(steps)` steps (about 50 over a run, at round numbers), and on the
first and last step, not one per step: a 10,000-step run's log stays readable.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from trainer.core.runfolder import RunFolder

LINES_PER_RUN = 50


def progress_every(steps: int) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50... that gives at most LINES_PER_RUN progress lines over `steps`."""
    every = 1
    while steps / every > LINES_PER_RUN:
        for factor in (2, 2.5, 2):  # 1 -> 2 -> 5 -> 10 -> 20 -> 50 ...
            every = int(every * factor)
            if steps / every <= LINES_PER_RUN:
                break
    return every


def duration(seconds) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def _metrics(event: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" for k, v in event.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("time", "step"))


class LogLines:
    """Formats events as log lines. `batch_total` turns samples/s into optimizer steps/s (it/s)."""

    def __init__(self, steps: int = 0, batch_total: int = 1):
        self.every = progress_every(steps) if steps else 1
        self.batch_total = max(1, batch_total)
        self.first_step: int | None = None

    def line(self, event: dict) -> str | None:
        text = self._text(event)
        if text is None:
            return None
        stamp = time.strftime("%H:%M:%S", time.localtime(event.get("time") or time.time()))
        return f"{stamp} {text}"

    def _text(self, e: dict) -> str | None:
        kind, step = e.get("type"), e.get("step")
        if kind == "progress":
            if self.first_step is None:
                self.first_step = step
            if not (step == self.first_step or step == e.get("steps") or (step or 0) % self.every == 0):
                return None
            rate = e.get("samples_per_s")
            parts = [f"step {step}/{e.get('steps')}",
                     f"loss {e['loss']:.4f}" if e.get("loss") is not None else "loss n/a",
                     f"lr {e['lr']:.2e}" if e.get("lr") is not None else None,
                     f"{rate / self.batch_total:.2f} it/s" if rate else None,
                     f"ETA {duration(e.get('eta_s'))}" if e.get("eta_s") is not None else None]
            return " · ".join(p for p in parts if p)
        if kind == "plan":
            return f"plan: {e.get('line') or ''}".rstrip() + "".join(f"\n  note: {n}" for n in e.get("notes") or ())
        if kind == "resumed":
            changes = ", ".join(f"{k} {v[0]!r} -> {v[1]!r}" for k, v in (e.get("changes") or {}).items())
            return (f"resumed at step {step} from {e.get('checkpoint')}" + (f" with {changes}" if changes else "")
                    + (f"\n  plan: {e['line']}" if e.get("line") else ""))
        if kind == "sample":
            return f"sample step {step} #{e.get('index')}: {e.get('prompt')!r} -> {e.get('path')}"
        if kind == "eval":
            return f"eval step {step}: {_metrics(e)}"
        if kind == "best":
            return f"best so far: step {step}, {e.get('metric')} {e.get('value'):.4g} -> {e.get('path')}"
        if kind == "checkpoint":
            return f"checkpoint step {step}: {e.get('path')}"
        if kind == "export":
            return f"exported the outputs of step {step}: " + ", ".join(e.get("outputs") or ())
        if kind == "warning":
            return f"warning: {e.get('message')}"
        if kind == "stopped":
            return (f"stopped at step {step} ({e.get('reason') or 'asked to'}); checkpoint {e.get('checkpoint')}; "
                    "continue with --resume (or Resume in the UI)")
        if kind == "done":
            return f"done at step {step}; outputs: " + ", ".join(e.get("outputs") or ())
        if kind == "failed":
            return f"failed: {e.get('reason')}"
        return None


def appender(run_dir: str | Path) -> Callable[[str], None]:
    """Appends a line to train.log (the launcher's own lines; O_APPEND, one write a line, beside torchrun's)."""
    path = RunFolder(Path(run_dir)).log

    def write(text: str) -> None:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError:
            pass  # the log is for reading; events.jsonl has the event
    return write


def launcher_echo(run_dir: str | Path) -> Callable[[dict], None]:
    """An EventLog echo for the launcher's events (plan, resumed, warnings, failures): their lines in train.log."""
    lines, write = LogLines(), appender(run_dir)

    def echo(event: dict) -> None:
        text = lines.line(event)
        if text:
            write(text)
    return echo


def worker_echo(run_dir: str | Path) -> Callable[[dict], None]:
    """An EventLog echo for rank 0: its lines on stdout, which the launcher sends to train.log."""
    try:
        plan = RunFolder(Path(run_dir)).read_plan()
        lines = LogLines(int(plan.get("steps") or 0), int(plan.get("total") or 1))
    except (OSError, ValueError):
        lines = LogLines()

    def echo(event: dict) -> None:
        text = lines.line(event)
        if text:
            print(text, flush=True)
    return echo
