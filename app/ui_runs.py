"""The "Runs" tab: every run folder, and the selected run followed live (a gr.Timer polls its folder).

Each tick re-reads the folder (incrementally) and sends only the parts that changed, so images and plots do not
flicker. The selected run lives in the browser page; on a reload the newest running run is selected again.
"""

from __future__ import annotations

import html
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gradio as gr
import pandas as pd

from app import runs as R
from app.sample_grid import grid_html
from trainer.core.checkpoint import latest_checkpoint
from trainer.core.event_types import DoneEvent, FailedEvent, StoppedEvent
from trainer.core.telemetry import LAG_MARGIN
from trainer.errors import UserError

LOG_LINES = 30  # lines of train.log shown
POLL_S = 2.0  # seconds between looks at the runs folder (only while the Runs tab is shown)
STATUS_TEXT = {
    "running": "running", "stopping": "stopping: saving a checkpoint", "finishing": "finishing",
    "done": "done", "stopped": "stopped",
    "failed": "failed", "unknown": "ended without a final event",
}


@dataclass
class RunsTab:
    table: gr.Dataframe
    select: gr.Dropdown
    header: gr.HTML
    failed: gr.HTML
    progress: gr.HTML
    stop: gr.Button
    resume: gr.Button
    resume_overrides: gr.Textbox
    delete: gr.Button
    kill: gr.Button
    confirm_row: gr.Row
    confirm_text: gr.Markdown
    confirm_yes: gr.Button
    confirm_no: gr.Button
    kill_row: gr.Row
    kill_text: gr.Markdown
    kill_yes: gr.Button
    kill_no: gr.Button
    message: gr.HTML
    loss_plot: gr.LinePlot
    lr_plot: gr.LinePlot
    eval_plot: gr.LinePlot
    eval_info: gr.HTML
    every: gr.HTML
    outputs: gr.File
    log: gr.Textbox
    seen: gr.State
    timer: gr.Timer


def build(ctx) -> RunsTab:
    with gr.Row(equal_height=False):
        select = gr.Dropdown(choices=[], value=None, label="Run", scale=1, elem_id="run-select", interactive=True,
                             info="The run shown below; or click a row of the table.")
        header = gr.HTML("", elem_id="run-header", scale=3)
    table = gr.Dataframe(headers=R.RUN_COLUMNS, value=[], interactive=False, max_height=230, elem_id="runs-table",
                         show_label=False, wrap=False)
    failed = gr.HTML("", visible=False, elem_id="run-failed")
    progress = gr.HTML(progress_html(None), elem_id="run-progress")
    with gr.Row(elem_id="run-actions"):
        stop = gr.Button("■  Stop", variant="stop", interactive=False, elem_id="stop-button", min_width=120)
        resume = gr.Button("▶  Resume", variant="primary", interactive=False, elem_id="resume-button", min_width=120)
        resume_overrides = gr.Textbox(placeholder="resume with changes, e.g. train.steps=600 (optional)",
                                      show_label=False, scale=2, elem_id="resume-overrides", container=False)
        delete = gr.Button("Delete…", interactive=False, elem_id="delete-button", min_width=100)
        kill = gr.Button("Kill now", interactive=False, elem_id="kill-button", min_width=100)
    gr.HTML('<div class="hint">Stop saves a checkpoint at the end of the current step; Resume continues from it at '
            'the same step, learning rate and data order. Kill ends a run that does not react to Stop (SIGTERM, then SIGKILL).</div>')
    with gr.Row(visible=False, elem_id="confirm-row", elem_classes=["msg-box", "warning"]) as confirm_row:
        confirm_text = gr.Markdown("")
        confirm_yes = gr.Button("Yes, delete it", variant="stop", elem_id="confirm-delete", size="md")
        confirm_no = gr.Button("Cancel", elem_id="cancel-delete", size="md")
    with gr.Row(visible=False, elem_id="confirm-kill-row", elem_classes=["msg-box", "warning"]) as kill_row:
        kill_text = gr.Markdown("")
        kill_yes = gr.Button("Yes, kill it", variant="stop", elem_id="confirm-kill", size="md")
        kill_no = gr.Button("Cancel", elem_id="cancel-kill", size="md")
    message = gr.HTML("", elem_id="run-message")
    # Each step's loss and its moving average (the trend a newcomer looks for under the timestep noise; with
    # held-out images, the validation loss at each evaluation beside them), and beside it the evaluations over steps
    # of a run that evaluates (the demo's concept and control scores, detection's mAP); under them the learning
    # rate and the latest evaluation in detail with the best step.
    with gr.Row(elem_id="plots-row"):
        loss_plot = line_plot(_loss_frame({}), x="step", y="loss", color="series", title="Loss", elem_id="loss-plot")
        eval_plot = line_plot(_eval_frame(()), x="step", y="value", color="metric", title="Evaluation",
                              elem_id="eval-plot")
    with gr.Row(elem_id="eval-row"):
        lr_plot = line_plot(_frame({}, "lr"), x="step", y="lr", title="Learning rate", elem_id="lr-plot")
        eval_info = gr.HTML("", elem_id="run-eval", visible=False)
    # Samples as a grid, prompts down and steps across (app.sample_grid); a click enlarges one.
    every = gr.HTML("", elem_id="samples-all", elem_classes=["samples"], visible=False)
    outputs = gr.File(label="Outputs: download the trained files", file_count="multiple", visible=False,
                      interactive=False, elem_id="run-outputs")
    with gr.Accordion("Log (last lines of train.log)", open=False, elem_id="log-accordion"):
        # Tall enough for the whole tail: the newest line is at the bottom without scrolling the box.
        log = gr.Textbox(show_label=False, lines=14, max_lines=LOG_LINES + 10, interactive=False, autoscroll=True,
                         elem_id="run-log")
    return RunsTab(table, select, header, failed, progress, stop, resume, resume_overrides, delete, kill, confirm_row,
                   confirm_text, confirm_yes, confirm_no, kill_row, kill_text, kill_yes, kill_no, message, loss_plot, lr_plot, eval_plot, eval_info, every,
                   outputs, log, gr.State({}), gr.Timer(POLL_S))


# Steps are whole numbers ("d", not Vega's "1.000000" for a one-point plot), their labels slanted so that neighbours
# do not run together ("280300" at a narrow plot's end); values with at most 3 significant digits, trailing zeros
# trimmed ("0.3", "0.0008").
X_FORMAT, Y_FORMAT, X_LABEL_ANGLE = "d", ".3~g", -30


def line_plot(value: pd.DataFrame, **kwargs: Any) -> gr.LinePlot:
    """A plot of the Runs tab: steps across, hidden until its first point."""
    return gr.LinePlot(value, x_axis_format=X_FORMAT, y_axis_format=Y_FORMAT, x_label_angle=X_LABEL_ANGLE,
                       height=260, visible=False, **kwargs)


def x_lim(steps: int) -> list | None:
    """The step axis spans the whole planned run (it fills as the run goes, at whole-number ticks that do not
    crowd at its end): none for a run of a few steps, whose fractional ticks would repeat a step number."""
    return [0, steps] if steps >= 10 else None


def _frame(series: dict, column: str) -> pd.DataFrame:
    return pd.DataFrame({"step": list(series), column: list(series.values())}, columns=["step", column])


def _loss_series(losses: dict) -> tuple[tuple, tuple]:
    """Each step's loss and its smoothed trend (smoothed over every step, then both thinned: app.runs.thin)."""
    return tuple(R.thin(losses).items()), tuple(R.thin(R.smoothed(losses)).items())


def _loss_rows_frame(per_step, trend, evaluated=()) -> pd.DataFrame:
    rows = [(step, "per step", value) for step, value in per_step]
    rows += [(step, "smoothed", value) for step, value in trend]
    rows += [(step, label, value) for step, label, value in evaluated]
    return pd.DataFrame(rows, columns=["step", "series", "loss"])


def _loss_frame(losses: dict, evaluated=()) -> pd.DataFrame:
    """Each step's loss, its smoothed trend, and `evaluated` (step, label, value): the evaluations' losses."""
    return _loss_rows_frame(*_loss_series(losses), evaluated)


def _eval_frame(rows) -> pd.DataFrame:
    return pd.DataFrame(list(rows), columns=["step", "metric", "value"])


def _fmt_metric(value) -> str:
    return "–" if value is None else f"{value:.3f}"


def eval_html(view: R.RunView | None) -> str:
    """The latest evaluation (its metrics, and per class for detection), and which step is the best so far."""
    latest = R.latest_eval(view) if view else None
    if view is None or latest is None:
        return ""
    images = f" on {latest['images']} validation images" if latest.get("images") else ""
    if latest.get("val_images"):
        images = f" on {latest['val_images']} held-out images"
    metrics = " · ".join(f"{html.escape(R.metric_label(k))} <b>{R.fmt_metric(k, v)}</b>"
                         for k, v in R.eval_metrics(latest))
    parts = [f'<div class="eval-head">Latest evaluation: step <b class="eval-step">{latest.get("step")}</b>'
             f'{images}</div><div class="eval-metrics">{metrics}</div>']
    best = view.best
    if best is not None:
        metric, value = best.metric, best.value
        shown = "–" if value is None else R.fmt_metric(metric, value)
        where = html.escape(best.path or "checkpoints/best")
        parts.append(f'<div class="eval-best" data-step="{best.step}">★ Best so far: step '
                     f'<b>{best.step}</b> ({html.escape(R.metric_label(metric))} {shown}), its weights kept in '
                     f'<code>{where}/</code></div>')
    rows = R.per_class_rows(latest)
    if rows:
        body = "".join(f"<tr><td>{html.escape(name)}</td><td>{_fmt_metric(ap)}</td><td>{_fmt_metric(ap50)}</td></tr>"
                       for name, ap, ap50 in rows)
        parts.append('<div class="per-class"><table><thead><tr><th>class</th><th title="COCO mAP, IoU 0.5:0.95">AP'
                     '</th><th title="IoU 0.5">AP50</th></tr></thead>'
                     f'<tbody>{body}</tbody></table></div>')
    return f'<div class="eval-box">{"".join(parts)}</div>'


def progress_html(view: R.RunView | None) -> str:
    if view is None:
        return '<div class="progress empty">No run selected. Start one from the <b>New run</b> tab.</div>'
    pct = 100.0 * view.step / view.steps if view.steps else 0.0
    parts = [f"step <b class='step' data-step='{view.step}'>{view.step}</b> / {view.steps or '?'}"]
    if view.active and not view.has_progress:
        parts.append("starting: loading the model (this takes a little while)")
    if view.status == "stopped":
        saved = not isinstance(view.final, StoppedEvent) or view.final.checkpoint is not None
        parts.append("checkpoint saved: Resume continues from here" if saved else "stopped before any checkpoint")
    if view.it_per_s:
        parts.append(f"{view.it_per_s:.2f} it/s")
    if view.active and view.eta_s is not None and view.has_progress:
        parts.append(f"ETA {R.fmt_duration(view.eta_s)}")
    if view.loss is not None:
        parts.append(f"loss {view.loss:.4f}")
    if view.lr is not None:
        parts.append(f"lr {view.lr:.2e}")
    bar_class = {"done": "done", "failed": "failed", "stopped": "stopped"}.get(view.status, "running")
    return (f'<div class="progress {bar_class}" data-status="{view.status}"><div class="bar">'
            f'<div class="fill{" started" if view.step else ""}" style="width:{pct:.1f}%"></div></div>'
            f'<div class="progress-text">{" · ".join(parts)}</div>{ranks_html(view)}</div>')


RANK_COLUMNS = (("step_s", "step s", "{:.3f}"), ("data_s", "input wait s", "{:.3f}"),
                ("forward_s", "forward s", "{:.3f}"), ("sync_s", "all-reduce s", "{:.3f}"),
                ("cpu_s", "CPU s", "{:.3f}"), ("rss_mb", "RSS MiB", "{:.0f}"), ("mem_mb", "GPU peak MiB", "{:.0f}"),
                ("util", "GPU %", "{:.0f}"))


def ranks_html(view: R.RunView) -> str:
    """Each rank's figures of the last reported step (trainer.engine.telemetry), the lagging rank marked."""
    if not view.ranks:
        return ""
    shown = [c for c in RANK_COLUMNS if any(c[0] in r for r in view.ranks)]
    head = "".join(f"<th>{title}</th>" for _, title, _ in shown)
    rows = []
    for figures in view.ranks:
        rank = int(figures.get("rank", 0))
        cells = "".join(f"<td>{fmt.format(figures[name]) if name in figures else ''}</td>" for name, _, fmt in shown)
        slow = " class='slowest'" if rank == view.slowest_rank else ""
        rows.append(f"<tr{slow} data-rank='{rank}'><td>{rank}</td>{cells}</tr>")
    lag = (f"<div class='run-note warn'>rank {view.slowest_rank} lags: its input wait + forward pass exceed the "
           f"median rank's by more than {LAG_MARGIN:.0%} of the step</div>" if view.slowest_rank is not None else "")
    return (f"<details class='rank-figures' open><summary>per rank, step {view.ranks_step}</summary>"
            f"<table><tr><th>rank</th>{head}</tr>{''.join(rows)}</table>{lag}</details>")


def header_html(view: R.RunView | None) -> str:
    if view is None:
        return ""
    shown = f"unreadable: {view.problem}" if view.status == "unreadable" else STATUS_TEXT.get(view.status, view.status)
    status = html.escape(shown)
    what = " · ".join(x for x in (view.family, view.method) if x)
    plan = f'<div class="run-plan">{html.escape(view.plan_line)}</div>' if view.plan_line else ""
    notes = "".join(f"<div class='run-note'>{html.escape(n)}</div>" for n in view.plan_notes)
    warnings = "".join(f"<div class='run-note warn'>⚠ {html.escape(w)}</div>" for w in view.shown_warnings)
    return (f'<div class="run-head" data-family="{html.escape(view.family)}">'
            f'<span class="run-name">{html.escape(view.name)}</span>'
            f'<span class="badge {view.status}" id="run-status">{status}</span>'
            f'<span class="run-what">{html.escape(what)} · started {R.fmt_time(view.started)}</span></div>'
            f'{plan}{notes}{warnings}{links_html(view)}')


def links_html(view: R.RunView) -> str:
    """Where else the run is: its TensorBoard folder (logging.tensorboard) and its Hub repo (output.push_to_hub).
    The URL comes from the run folder, which is data: shown only as an http(s) link, escaped."""
    links = []
    board = view.path / "tensorboard"
    if board.is_dir():
        links.append(f"TensorBoard: <code>tensorboard --logdir {html.escape(str(board))}</code>")
    hub = view.final.hub if isinstance(view.final, DoneEvent) and view.status == "done" else None
    if isinstance(hub, str) and hub.startswith(("https://", "http://")):
        url = html.escape(hub, quote=True)
        links.append(f'Hub: <a href="{url}" target="_blank" rel="noopener noreferrer">{url}</a>')
    return "".join(f"<div class='run-note run-link'>{link}</div>" for link in links)


def resume_hint(view: R.RunView) -> str:
    """Where Resume would continue from, read from the checkpoints on disk (not assumed)."""
    ckpt = latest_checkpoint(view.path)
    if ckpt is None:
        return ("It saved no checkpoint, so Resume cannot continue it: start it again from the <b>New run</b> tab "
                "(or Delete it).")
    where = html.escape(str(ckpt.path.relative_to(view.path)))
    return f"<b>Resume</b> continues from its newest checkpoint, <code>{where}</code> (step {ckpt.step})."


def failed_html(view: R.RunView | None) -> str:
    if view is None or view.status not in ("failed", "unknown"):
        return ""
    killed = isinstance(view.final, FailedEvent) and view.final.killed
    if view.status == "unknown":
        title = "It ended without a word"
        reason = ("Its processes are gone and wrote no final event: they were killed from outside (SIGKILL, out of "
                  "memory) or the machine went down. train.log's last lines may say more.")
    else:
        title = "Killed" if killed else "Why it failed"
        reason = view.final.reason if isinstance(view.final, FailedEvent) else "no reason given"
    todo = "" if killed or view.status == "unknown" else "Fix what it names, then: "
    return (f'<div class="msg-box error"><b>{title}</b><pre class="reason">{html.escape(reason)}</pre>'
            f'<div class="resume-hint">{todo}{resume_hint(view)}</div></div>')


@dataclass(frozen=True)
class Shown:
    """What every output is computed from: the runs, and the selected one (None when none is)."""
    views: list[R.RunView]
    view: R.RunView | None
    runs_dir: Path


def _visible(value) -> dict:
    return gr.update(value=value, visible=bool(value))


def _interactive(on: bool) -> dict:
    return gr.update(interactive=on)


def _as_is(value):
    return value


@dataclass(frozen=True)
class Output:
    """One output of the Runs tab, declared once: the RunsTab field it updates, what it shows (compared with what
    is on screen, so it is sent only when it changed) and the update that shows it."""
    name: str
    value: Callable[[Shown], Any]
    update: Callable[[Any], Any] = _as_is


def _loss_update(value) -> dict:
    per_step, trend, evaluated, steps = value
    # Drawn (made visible) with their first point: Vega sizes the axes on the first draw.
    return gr.update(value=_loss_rows_frame(per_step, trend, evaluated), visible=bool(per_step or evaluated),
                     x_lim=x_lim(steps))


def _steps(s: Shown) -> int:
    return s.view.steps if s.view else 0


def _running(s: Shown) -> bool:
    return s.view is not None and s.view.status == "running"


def _ended(s: Shown) -> bool:
    return s.view is not None and not s.view.active


# The Runs tab's outputs, in the order Gradio gets them: a new panel is one line here (and its component in build).
OUTPUTS: tuple[Output, ...] = (
    Output("table", lambda s: R.queue_rows(s.runs_dir) + R.run_rows(s.views), lambda v: gr.update(value=v)),
    Output("select", lambda s: (tuple(v.name for v in s.views), s.view.name if s.view else None),
           lambda v: gr.update(choices=list(v[0]), value=v[1])),
    Output("header", lambda s: header_html(s.view)),
    Output("failed", lambda s: failed_html(s.view), _visible),
    Output("progress", lambda s: progress_html(s.view)),
    Output("stop", _running, _interactive),
    Output("resume", _ended, _interactive),
    Output("delete", _ended, _interactive),
    Output("kill", lambda s: s.view is not None and s.view.active, _interactive),
    Output("loss_plot", lambda s: (*_loss_series(dict(sorted(s.view.losses.items()))), tuple(R.eval_losses(s.view)),
                                   _steps(s)) if s.view else ((), (), (), 0), _loss_update),
    Output("lr_plot", lambda s: (tuple(R.thin(dict(sorted(s.view.lrs.items()))).items()) if s.view else (),
                                 _steps(s)),
           lambda v: gr.update(value=_frame(dict(v[0]), "lr"), visible=bool(v[0]), x_lim=x_lim(v[1]))),
    Output("eval_plot", lambda s: (tuple(R.eval_series(s.view)) if s.view else (), _steps(s)),
           lambda v: gr.update(value=_eval_frame(v[0]), visible=bool(v[0]), x_lim=x_lim(v[1]))),
    Output("eval_info", lambda s: eval_html(s.view), _visible),
    Output("every", lambda s: grid_html(s.view), _visible),
    Output("outputs", lambda s: tuple(R.output_files(s.view.path)) if s.view and s.view.status == "done" else (),
           lambda v: gr.update(value=list(v) or None, visible=bool(v))),
    Output("log", lambda s: R.log_tail(s.view.path, LOG_LINES) if s.view else ""),
)
# What render() updates, in its order: the outputs, then `seen` (what they show now).
OUTPUT_NAMES = (*(o.name for o in OUTPUTS), "seen")


class SharedRenders:
    """The latest snapshot of each (runs folder, run), shared by every session: 20 pages polling a training run
    cost about one snapshot a second, not 20 (each session still gets only what it lacks). A snapshot is reused
    while the folder's fingerprint is the one it was made at, or for `fresh_s` after it was made (a training run
    changes its folder every step); `seen` then carries that older fingerprint, so the next tick catches up. What
    the fingerprint cannot see (a run prepared a moment ago counts as running for 10 s: app.runs) is looked at again
    after `max_age_s`."""

    def __init__(self, fresh_s: float = 1.0, max_age_s: float = 10.0, size: int = 64):
        self.fresh_s, self.max_age_s, self.size, self._lock = fresh_s, max_age_s, size, threading.Lock()
        self._data: OrderedDict[tuple, tuple[str, float, dict]] = OrderedDict()

    def get(self, key: tuple, fingerprint: str, make: Callable[[], dict], fresh_ok: bool = True) -> tuple[str, dict]:
        """(the fingerprint the snapshot was made at, the snapshot); `fresh_ok`: False after a user's action, whose
        result must show at once."""
        now = time.monotonic()
        with self._lock:
            found = self._data.get(key)
            if found is not None:
                made_at, made, data = found
                recent = fresh_ok and now - made < self.fresh_s
                if now - made < self.max_age_s and (made_at == fingerprint or recent):
                    return made_at, data
        data = make()  # outside the lock: two sessions may both make it, never wait on each other
        with self._lock:
            self._data[key] = (fingerprint, now, data)
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)
        return fingerprint, data


SHARED = SharedRenders()


def snapshot(ctx, name: str | None) -> dict:
    """Every output's content for run `name`, keyed by output name."""
    views = R.list_runs(ctx.jobs.runs_dir)
    shown = Shown(views, next((v for v in views if v.name == name), None), Path(ctx.jobs.runs_dir))
    return {o.name: o.value(shown) for o in OUTPUTS}


def render(data: dict, seen: dict) -> list:
    """Updates for RunsTab.outputs() (gr.skip() for what did not change since `seen`), then the new `seen`."""
    return [o.update(data[o.name]) if seen.get(o.name) != data[o.name] else gr.skip() for o in OUTPUTS] + [dict(data)]


def by_name(updates: list) -> dict:
    """render()'s updates keyed by output name."""
    return dict(zip(OUTPUT_NAMES, updates))


def refresh(ctx, name: str | None, seen: dict | None, fresh_ok: bool = False) -> list:
    """Updates for RunsTab.outputs() showing run `name` now, relative to `seen` (what is on screen)."""
    # The fingerprint is taken before the snapshot (a change in between re-renders on the next tick) and travels
    # in `seen` with what was rendered. Responses can arrive out of order (a queued Stop's refresh after a later
    # tick's); whichever lands last, the next tick compares against what is on screen. With the fingerprint kept
    # apart, a stale 'stopping' that landed after the tick that rendered 'stopped' stayed for good (seen on CI).
    now = R.fingerprint(ctx.jobs.runs_dir, name)
    made_at, data = SHARED.get((str(ctx.jobs.runs_dir), name), now, lambda: snapshot(ctx, name), fresh_ok)
    return render({**data, "fingerprint": made_at}, seen or {})


def tick(ctx, name: str | None, seen: dict | None) -> list:
    """The timer's poll: nothing (gr.skip() everywhere) while the runs folder's fingerprint is what `seen` shows."""
    if R.fingerprint(ctx.jobs.runs_dir, name) == (seen or {}).get("fingerprint"):
        return [gr.skip()] * len(OUTPUT_NAMES)
    updates = refresh(ctx, name, seen, fresh_ok=True)  # a poll may show a snapshot up to SHARED.fresh_s old
    # A poll leaves the page's selection alone unless the selected run is gone: a tick sent before the page's load
    # had picked its run (name None) answered after it on a busy machine, and its `value: None` cleared the
    # selection for good ("No run selected" beside a running run, seen on CI). Its other outputs are corrected by
    # the next tick, which compares against what this one showed.
    i = OUTPUT_NAMES.index("select")
    gone = name is not None and isinstance(updates[i], dict) and updates[i].get("value") is None
    if isinstance(updates[i], dict) and not gone:
        updates[i] = {k: v for k, v in updates[i].items() if k != "value"}
    return updates


def outputs_of(t: RunsTab) -> list:
    return [getattr(t, name) for name in OUTPUT_NAMES]


def ask_kill(ctx, name: str | None):
    """The Kill confirmation: what a kill loses, from the checkpoints on disk."""
    try:
        run_dir = ctx.jobs.run_dir(name or "")
    except UserError:
        return gr.skip(), gr.skip()
    ckpt = latest_checkpoint(run_dir)
    kept = (f"its newest checkpoint is step {ckpt.step}; the steps after it are lost" if ckpt else
            "it has saved no checkpoint yet, so it cannot be resumed afterwards")
    return gr.update(visible=True), (f"Kill run **{name}** now? Its processes get SIGTERM, then SIGKILL after 10 "
                                     f"seconds; {kept}. **Stop** ends it after this step with a checkpoint instead.")


def pick_default(ctx) -> str | None:
    """The run a freshly opened page follows: the newest running one, else the newest."""
    views = R.list_runs(ctx.jobs.runs_dir)
    candidates = [v for v in views if v.active] or views
    return candidates[0].name if candidates else None


def wire(ctx, t: RunsTab, tabs: gr.Tabs) -> None:
    outs = outputs_of(t)

    def refresh_(name, seen):
        return refresh(ctx, name, seen)

    # Each tick fingerprints the runs folder (sizes, pids) and re-renders only when that changed, sending only the
    # parts that changed. Outside Gradio's queue: its per-event streaming costs the browser far more than this call.
    t.timer.tick(lambda name, seen: tick(ctx, name, seen), inputs=[t.select, t.seen], outputs=outs,
                 show_progress="hidden", trigger_mode="once", queue=False, api_name="tick")

    def on_select(evt: gr.SelectData):  # the chosen run comes with the event (a dropdown's value may lag)
        return [*refresh_(evt.value, {}), ""]

    t.select.select(on_select, outputs=[*outs, t.message], show_progress="hidden")

    def on_table_select(evt: gr.SelectData):
        row = evt.row_value or []
        return row[0] if row and not str(row[3]).startswith("queued") else gr.skip()  # a queued run has no folder

    t.table.select(on_table_select, outputs=[t.select]).then(
        lambda name: refresh_(name, {}), inputs=[t.select], outputs=outs, show_progress="hidden")

    def open_runs_if_training():  # a page opened (or reloaded) while a run trains shows that run
        return gr.Tabs(selected="runs") if any(v.active for v in R.list_runs(ctx.jobs.runs_dir)) else gr.skip()

    # The tab first, then what it shows: plots drawn while the tab was being switched to stayed blank boxes.
    ctx.blocks.load(open_runs_if_training, outputs=[tabs], show_progress="hidden").then(
        lambda: refresh_(pick_default(ctx), {}), outputs=outs, show_progress="hidden", api_name="runs")

    def act(fn, done: str):
        def handler(name, *args):
            try:
                fn(name, *args)
            except (UserError, OSError) as exc:
                return f'<div class="msg-box error">{html.escape(str(exc))}</div>'
            return f'<div class="msg-box ok">{html.escape(done.format(name=name))}</div>'
        return handler

    then = dict(fn=lambda name, seen: refresh_(name, seen), inputs=[t.select, t.seen], outputs=outs,
                show_progress="hidden")
    t.stop.click(act(ctx.jobs.stop, "Stopping {name}: it saves a checkpoint at the end of this step, then shows "
                                    "'stopped'."), inputs=[t.select], outputs=[t.message]).then(**then)
    t.kill.click(lambda name: ask_kill(ctx, name), inputs=[t.select], outputs=[t.kill_row, t.kill_text])
    t.kill_no.click(lambda: gr.update(visible=False), outputs=[t.kill_row])

    def do_kill(name):
        message = act(ctx.jobs.kill, "Killing {name}: SIGTERM now, SIGKILL after 10 seconds; the box above says "
                                     "how it ended.")(name)
        return gr.update(visible=False), message

    t.kill_yes.click(do_kill, inputs=[t.select], outputs=[t.kill_row, t.message]).then(**then)

    def do_resume(name, overrides):
        ctx.jobs.resume(name, (overrides or "").split())

    t.resume.click(act(do_resume, "Resumed {name} from its newest checkpoint."),
                   inputs=[t.select, t.resume_overrides], outputs=[t.message], api_name="resume").then(**then)

    def ask_delete(name):
        if not name:
            return gr.skip(), gr.skip()
        return gr.update(visible=True), (f"Delete run **{name}** with its samples, checkpoints and outputs? "
                                         "This cannot be undone.")

    t.delete.click(ask_delete, inputs=[t.select], outputs=[t.confirm_row, t.confirm_text])
    t.confirm_no.click(lambda: gr.update(visible=False), outputs=[t.confirm_row])

    def do_delete(name):
        message = act(ctx.jobs.delete, "Deleted {name}.")(name)
        return gr.update(visible=False), message, pick_default(ctx)

    t.confirm_yes.click(do_delete, inputs=[t.select], outputs=[t.confirm_row, t.message, t.select]).then(
        lambda name: refresh_(name, {}), inputs=[t.select], outputs=outs, show_progress="hidden")
