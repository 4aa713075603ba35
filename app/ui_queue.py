"""The Runs tab's queue control: the queued runs (also rows `queued #N` of the runs table), Earlier / Later and Cancel. Hidden while
the queue is empty; refreshed on the Runs tab's timer when the queue folder changes (a run queued, cancelled or
started, by this UI, another one or the command line: trainer.core.queue)."""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from app.queue_view import queue_choices, queue_stamp
from trainer.core import queue


@dataclass
class QueuePanel:
    row: gr.Row
    entry: gr.Dropdown
    up: gr.Button
    down: gr.Button
    cancel: gr.Button
    message: gr.HTML
    shown: gr.State  # the queue folder's stamp the panel shows


def build() -> QueuePanel:
    with gr.Row(visible=False, elem_id="queue-row", equal_height=True) as row:
        entry = gr.Dropdown(choices=[], value=None, label="Queued runs (each starts when its devices are "
                            "free)", interactive=True, scale=3, elem_id="queue-entry")
        up = gr.Button("▲ Earlier", elem_id="queue-up", scale=0, min_width=100)
        down = gr.Button("▼ Later", elem_id="queue-down", scale=0, min_width=100)
        cancel = gr.Button("Cancel queued run", elem_id="queue-cancel", scale=1, min_width=140)
    message = gr.HTML("", elem_id="queue-message")
    return QueuePanel(row, entry, up, down, cancel, message, gr.State(-1))


def view(ctx, chosen) -> list:
    choices = queue_choices(ctx.jobs.runs_dir)
    ids = [i for _, i in choices]
    return [gr.update(visible=bool(choices)),
            gr.update(choices=choices, value=chosen if chosen in ids else (ids[0] if ids else None))]


def wire(ctx, runs, p: QueuePanel) -> None:
    def tick(chosen, shown):
        now = queue_stamp(ctx.jobs.runs_dir)
        return [gr.skip(), gr.skip(), gr.skip()] if now == shown else [*view(ctx, chosen), now]

    runs.timer.tick(tick, inputs=[p.entry, p.shown], outputs=[p.row, p.entry, p.shown], show_progress="hidden",
                    trigger_mode="once", queue=False)
    ctx.blocks.load(lambda: [*view(ctx, None), queue_stamp(ctx.jobs.runs_dir)], outputs=[p.row, p.entry, p.shown])

    def cancel(entry_id):
        label = dict((i, text) for text, i in queue_choices(ctx.jobs.runs_dir)).get(entry_id, "that run")
        if entry_id and queue.cancel(ctx.jobs.runs_dir, entry_id):
            return f'<div class="msg-box ok">Cancelled {html.escape(label)}: it will not start.</div>'
        return '<div class="msg-box error">That run is no longer queued (it started, or was cancelled).</div>'

    shown_again = dict(fn=lambda chosen: [*view(ctx, chosen), queue_stamp(ctx.jobs.runs_dir)], inputs=[p.entry],
                       outputs=[p.row, p.entry, p.shown])
    p.cancel.click(cancel, inputs=[p.entry], outputs=[p.message], api_name="cancel_queued").then(**shown_again)

    def move(by: int):
        def handler(entry_id):
            label = dict((i, text) for text, i in queue_choices(ctx.jobs.runs_dir)).get(entry_id)
            if label is None:
                return ('<div class="msg-box error">That run is no longer queued (it started, or was cancelled).'
                        '</div>', gr.skip())
            moved = queue.move(ctx.jobs.runs_dir, entry_id, by)
            if moved is None:
                return (f'<div class="msg-box">{html.escape(label)} is already {"first" if by < 0 else "last"}.'
                        '</div>', gr.skip())
            # Its new id (the number in it is its place), still chosen, so pressing again moves it on.
            return "", gr.update(choices=queue_choices(ctx.jobs.runs_dir), value=moved)
        return handler

    p.up.click(move(-1), inputs=[p.entry], outputs=[p.message, p.entry], api_name="queue_earlier").then(
        **shown_again)
    p.down.click(move(1), inputs=[p.entry], outputs=[p.message, p.entry], api_name="queue_later").then(
        **shown_again)
