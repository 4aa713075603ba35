"""Read run folders into what the Runs page shows. Read-only and torch-free.

Everything comes from the run folder (README: The run folder): events.jsonl (read incrementally, cached per folder),
config.yaml, train.log, samples/, output/. So whatever started a run (this UI before a restart, launch.py in a
terminal), the page shows it, and a browser refresh finds it again.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.run_checks import Unreadable, config_summary, number_or_zero, section
from trainer.core.assets import DEMO_DIR
from trainer.core.event_types import (AnyEvent, BadEvent, BestEvent, DoneEvent, EvalEvent, FailedEvent, FinalEvent,
                                      PlanEvent, ProgressEvent, ResumedEvent, SampleEvent, StoppedEvent, WarningEvent,
                                      parse)
from trainer.core.runfolder import CONFIG_FILE, EVENTS_FILE, LOG_FILE, PID_FILE, STOP_FILE, RunFolder, tail_lines
from trainer.core.stall import STALL_PREFIX
from app.queue_view import queue_rows, queue_stamp  # noqa: F401  (queue_rows: the Runs tab's table, R.queue_rows)

RUN_COLUMNS = ["run", "family", "method", "status", "step", "loss", "started"]


class EventCache:
    """events.jsonl of each run, read from where the last read stopped (a rewritten file is read again), each line
    parsed into its typed event once (trainer.core.event_types.parse), or kept as the BadEvent saying why not."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: dict[Path, tuple[int, int, list]] = {}  # folder -> (offset, inode, events)

    def events(self, run_dir: Path) -> list[AnyEvent | BadEvent]:
        path = Path(run_dir) / EVENTS_FILE
        with self._lock:
            try:
                stat = path.stat()
            except OSError:
                self._runs.pop(Path(run_dir), None)
                return []
            offset, inode, events = self._runs.get(Path(run_dir), (0, stat.st_ino, []))
            if inode != stat.st_ino or stat.st_size < offset:
                offset, events = 0, []
            if stat.st_size > offset:
                events = list(events)
                with open(path, "rb") as f:
                    f.seek(offset)
                    for line in f:
                        if not line.endswith(b"\n"):
                            break  # half-written: read it next time
                        offset += len(line)
                        try:
                            event = json.loads(line)
                        except ValueError:  # not JSON, or not UTF-8: a torn or foreign line
                            continue
                        if isinstance(event, dict):
                            typed: AnyEvent | BadEvent | None
                            try:
                                typed = parse(event)
                            except BadEvent as exc:
                                typed = exc
                            if typed is not None:  # None: a kind this page does not show
                                events.append(typed)
            self._runs[Path(run_dir)] = (offset, stat.st_ino, events)
            return events


CACHE = EventCache()


def _pid_alive(run_dir: Path) -> bool:
    return RunFolder(run_dir).is_alive()


@dataclass
class RunView:
    """One run as the page shows it."""

    path: Path
    name: str
    status: str = "unknown"  # running | stopping | finishing | done | stopped | failed | unknown | unreadable
    problem: str = ""  # why an unreadable run could not be read
    family: str = ""
    method: str = ""
    step: int = 0
    steps: int = 0
    loss: float | None = None
    lr: float | None = None
    it_per_s: float | None = None
    eta_s: float | None = None
    started: float | None = None
    plan_line: str = ""
    plan_notes: list[str] = field(default_factory=list)
    final: FinalEvent | None = None
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (a resumed step replaces the old one)
    lrs: dict[int, float] = field(default_factory=dict)
    samples: dict[tuple[int, int], SampleEvent] = field(default_factory=dict)  # (step, prompt index) -> its event
    warnings: list[str] = field(default_factory=list)
    stall: str | None = None  # the launcher's stall warning, while no step has followed it (trainer.core.stall)
    evals: dict[int, dict] = field(default_factory=dict)  # step -> its `eval` events, merged
    best: BestEvent | None = None  # the latest `best` event
    has_progress: bool = False  # this launch reported a step (else it is still loading the model)
    ranks: list[dict] = field(default_factory=list)  # each rank's figures of step `ranks_step` (trainer.engine.telemetry)
    ranks_step: int = 0
    slowest_rank: int | None = None

    @property
    def active(self) -> bool:
        return self.status in ("running", "stopping", "finishing")

    @property
    def shown_warnings(self) -> list[str]:
        """The last three warnings, and a stall warning that nothing has answered yet."""
        return self.warnings[-3:] + ([self.stall] if self.stall else [])


def read_run(run_dir: str | Path, cache: EventCache = CACHE) -> RunView:
    """The run as the page shows it; a folder holding what no writer of ours writes is `unreadable`, with why,
    so that one broken (or planted) run folder cannot break the page for every other run."""
    try:
        return _read_run(Path(run_dir), cache)
    except Exception as exc:  # noqa: BLE001 -- any surprise in one folder stays in its own row
        if isinstance(exc, BadEvent):
            reason = f"{EVENTS_FILE}: {exc}"
        else:
            reason = str(exc) if isinstance(exc, Unreadable) else f"{type(exc).__name__}: {exc}"
        return RunView(path=Path(run_dir), name=Path(run_dir).name, status="unreadable", problem=reason[:200])


def _read_run(run_dir: Path, cache: EventCache) -> RunView:
    view = RunView(path=run_dir, name=run_dir.name)
    config = config_summary(run_dir)
    view.family = str(section(config, "model").get("family", ""))
    view.method = str(config.get("method", ""))
    view.steps = number_or_zero(section(config, "train").get("steps"), f"{CONFIG_FILE}: train.steps")
    total = None
    for event in cache.events(run_dir):
        if isinstance(event, BadEvent):
            raise event  # this run's row says which field is wrong
        if view.started is None:
            view.started = event.time
        if isinstance(event, PlanEvent):
            view.plan_line, view.plan_notes = event.line, list(event.notes)
            total, view.steps = event.total or total, event.steps or view.steps
            view.final, view.has_progress = None, False
        elif isinstance(event, ResumedEvent):
            plan = event.plan or PlanEvent()
            view.plan_line = event.line or plan.line or view.plan_line
            view.plan_notes = list(plan.notes)
            total, view.steps = plan.total or total, plan.steps or view.steps
            view.step = event.step
            view.final, view.has_progress, view.eta_s, view.it_per_s = None, False, None, None
            view.ranks, view.slowest_rank, view.stall = [], None, None
        elif isinstance(event, ProgressEvent):
            view.has_progress, view.stall = True, None
            view.step, view.steps = event.step, event.steps or view.steps
            view.loss, view.lr, view.eta_s = event.loss, event.lr, event.eta_s
            rate = event.samples_per_s
            view.it_per_s = rate / total if rate and total else None
            if event.ranks:
                view.ranks, view.ranks_step = event.ranks, event.ranks_step or 0
                view.slowest_rank = event.slowest_rank
            if view.loss is not None:
                view.losses[view.step] = view.loss
            if view.lr is not None:
                view.lrs[view.step] = view.lr
        elif isinstance(event, SampleEvent):
            view.samples[(event.step, event.index)] = event
        elif isinstance(event, EvalEvent):
            # A step's scores (sample steps: concept/control) and its evaluation (val_loss, mAP) are separate
            # events: merged; a re-evaluated step's metrics replace the earlier ones.
            view.evals[event.step] = {**view.evals.get(event.step, {}), **event.extra, "step": event.step}
        elif isinstance(event, BestEvent):
            view.best = event
        elif isinstance(event, WarningEvent):
            if event.message.startswith(STALL_PREFIX):
                view.stall = event.message  # true until the run steps again or ends, not for good
            else:
                view.warnings.append(event.message)
        elif isinstance(event, (DoneEvent, StoppedEvent, FailedEvent)):
            view.final, view.stall = event, None
            if isinstance(event, DoneEvent) and event.step is not None:
                view.step = event.step
    if view.final is not None:
        # The workers wrote how it ended; until torchrun itself has exited, it is not safe to resume or delete.
        ended = view.final.kind
        view.status = ended if not _pid_alive(run_dir) else ("stopping" if ended == "stopped" else "finishing")
    elif _pid_alive(run_dir):
        view.status = "stopping" if (run_dir / STOP_FILE).exists() else "running"
    elif view.started is not None and time.time() - view.started < 10 and not (run_dir / PID_FILE).exists():
        view.status = "running"  # prepared a moment ago; torchrun is being started
    return view


def run_dirs(runs_dir: str | Path) -> list[Path]:
    """Run folders (a folder with a config.yaml or an events.jsonl; the demo assets are not runs)."""
    root = Path(runs_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and p.name != DEMO_DIR and not p.name.startswith(".")
             and ((p / EVENTS_FILE).exists() or (p / CONFIG_FILE).exists())]
    return sorted(found)


def list_runs(runs_dir: str | Path, cache: EventCache = CACHE) -> list[RunView]:
    """Every run, newest first (by its first event)."""
    views = [read_run(p, cache) for p in run_dirs(runs_dir)]
    return sorted(views, key=lambda v: (v.started or 0, v.name), reverse=True)


def fingerprint(runs_dir: str | Path, selected: str | None) -> str:
    """Changes whenever what the Runs page shows could have changed: a run appears or goes, its events grow, a
    STOP file appears, its processes end; for the selected run also its log and outputs. Cheap: stats only."""
    parts = []
    for run in run_dirs(runs_dir):
        try:
            size = (run / EVENTS_FILE).stat().st_size
        except OSError:
            size = -1
        parts.append(f"{run.name}:{size}:{(run / STOP_FILE).exists()}:{_pid_alive(run)}")
        if run.name == selected:
            for extra in (run / LOG_FILE, RunFolder(run).output):
                try:
                    parts.append(f"{extra.name}:{extra.stat().st_mtime_ns}")
                except OSError:
                    pass
    return f"{selected}|queue:{queue_stamp(runs_dir)}|" + "|".join(parts)


def fmt_duration(seconds) -> str:
    if seconds is None:
        return "?"
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else ""


def run_rows(views: list[RunView]) -> list[list]:
    """Rows of the runs table (RUN_COLUMNS)."""
    return [[v.name, v.family, v.method, f"unreadable: {v.problem}" if v.status == "unreadable" else v.status,
             f"{v.step}/{v.steps}" if v.steps else str(v.step),
             f"{v.loss:.4f}" if v.loss is not None else "", fmt_time(v.started)] for v in views]


def latest_samples(view: RunView) -> list[tuple[str, str]]:
    """(image path, caption) of the newest sample of each prompt."""
    newest: dict[int, tuple[int, SampleEvent]] = {}
    for (step, index), event in view.samples.items():
        if index not in newest or step > newest[index][0]:
            newest[index] = (step, event)
    return [(str(view.path / e.path), f"step {s} · {e.prompt}")
            for _, (s, e) in sorted(newest.items()) if (view.path / e.path).is_file()]


def all_samples(view: RunView) -> list[tuple[str, str]]:
    """Every sample, newest step first, prompts in order within a step (a grid of steps x prompts)."""
    keys = sorted(view.samples, key=lambda k: (-k[0], k[1]))
    return [(str(view.path / view.samples[k].path), f"step {k[0]} · {view.samples[k].prompt}")
            for k in keys if (view.path / view.samples[k].path).is_file()]


# How metrics are labelled (detection's COCO metrics, the diffusion families' validation loss); others show
# under their own names, in the order of this table first.
METRIC_LABELS = {"map": "mAP", "map50": "mAP50", "map75": "mAP75", "mar100": "mAR100", "val_loss": "val loss",
                 "concept": "concept score", "control": "control score"}
# Shown in the latest evaluation, not over steps: detection's finer COCO numbers would crowd its mAP plot.
NOT_PLOTTED = {"map75", "mar100"}
NOT_METRICS = {"type", "time", "step", "per_class", "images", "val_images"}


def metric_label(key: str) -> str:
    return METRIC_LABELS.get(key, key)


def is_loss(key: str) -> bool:
    """A loss (`val_loss`) is drawn on the loss plot, next to the training loss it compares with; every other
    metric on the evaluation plot."""
    return key == "loss" or key.endswith("_loss")


def fmt_metric(key: str, value: float) -> str:
    return f"{value:.4f}" if is_loss(key) else f"{value:.3f}"


def as_number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def eval_metrics(event: dict | None) -> list[tuple[str, float]]:
    """(key, value) of an `eval` event's plain-number metrics, detection's in COCO's order first."""
    event = event or {}
    keys = [k for k in METRIC_LABELS if k in event] + [k for k in event if k not in METRIC_LABELS]
    return [(k, v) for k in keys if k not in NOT_METRICS and (v := as_number(event[k])) is not None]


def eval_series(view: RunView) -> list[tuple[int, str, float]]:
    """(step, metric label, value) of every evaluation, steps in order, for a plot with one line per metric:
    every plain number the evaluations report (scores of any kind), but losses (`eval_losses`) and
    `NOT_PLOTTED`."""
    reported = {k for e in view.evals.values() for k, _ in eval_metrics(e)}
    keys = [k for k in dict.fromkeys([*METRIC_LABELS, *sorted(reported)])
            if k in reported and k not in NOT_PLOTTED and not is_loss(k)]
    rows: list[tuple[int, str, float]] = []
    for step in sorted(view.evals):
        values = dict(eval_metrics(view.evals[step]))
        rows.extend((step, metric_label(k), values[k]) for k in keys if k in values)
    return rows


def eval_losses(view: RunView) -> list[tuple[int, str, float]]:
    """(step, label, value) of the losses the evaluations report (`val_loss`), for the loss plot."""
    return [(step, metric_label(k), v) for step in sorted(view.evals)
            for k, v in eval_metrics(view.evals[step]) if is_loss(k)]


def latest_eval(view: RunView) -> dict | None:
    return view.evals[max(view.evals)] if view.evals else None


def per_class_rows(event: dict | None) -> list[tuple[str, float | None, float | None]]:
    """(class, AP, AP50) of an `eval` event's per-class metrics, best AP first (classes without one last)."""
    per_class = (event or {}).get("per_class") or {}
    if not isinstance(per_class, dict):
        return []
    rows = [(str(name), as_number((m or {}).get("map")), as_number((m or {}).get("map50")))
            for name, m in per_class.items() if isinstance(m, dict) or m is None]
    return sorted(rows, key=lambda r: (r[1] is None, -(r[1] or 0.0), r[0]))


def prompt_count(view: RunView) -> int:
    return max((index for _, index in view.samples), default=-1) + 1


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def smoothed(series: dict[int, float], weight: float = 0.9) -> dict[int, float]:
    """An exponential moving average of a noisy per-step series (diffusion losses jump with the random timestep
    of each step), bias-corrected like TensorBoard's smoothing so the first points are not pulled towards 0."""
    out, average, norm = {}, 0.0, 0.0
    for step in sorted(series):
        average = weight * average + (1 - weight) * series[step]
        norm = weight * norm + (1 - weight)
        out[step] = average / norm
    return out


PLOT_POINTS = 600  # points a plot line gets at most: a 100k-step run's curve, drawn and sent as 600


def thin(series: dict[int, float], limit: int = PLOT_POINTS) -> dict[int, float]:
    """`series` (step -> value, steps in order) with at most about `limit` points: every k-th step and the last,
    so a long run's plot costs the page (and the server rendering it for every session) what a short one does."""
    if len(series) <= limit:
        return series
    steps = sorted(series)
    stride = -(-len(steps) // limit)
    kept = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
    return {step: series[step] for step in kept}


def log_tail(run_dir: str | Path, count: int = 40) -> str:
    """The last lines of train.log (progress bars' carriage returns split into lines, terminal codes removed)."""
    lines: list[str] = []
    for line in tail_lines(Path(run_dir) / LOG_FILE, count):
        lines.extend(part for part in _ANSI.sub("", line).split("\r") if part.strip())
    return "\n".join(lines[-count:])


def output_files(run_dir: str | Path) -> list[str]:
    """The run's final artifacts to download: the files directly in output/ (a LoRA's .safetensors files, a full
    fine-tune's single-file checkpoint). Folders (a diffusers model) stay on disk, at their path in the run folder."""
    root = RunFolder(Path(run_dir)).output
    if not root.is_dir():
        return []
    return sorted(str(p) for p in root.iterdir() if p.is_file() and p.stat().st_size > 0)
