"""The Runs tab's "Upload to the Hugging Face Hub" panel: a done run's outputs, last samples and model card to a
repo the user names, through app.hub_uploads (`launch.py --push-to-hub` in a process of its own, with this
machine's HF_TOKEN). Refused on a UI reachable from other machines. Its message follows the upload on the Runs
tab's timer."""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from trainer.errors import UserError

_BOX = {"uploading": "msg-box", "ok": "msg-box ok", "error": "msg-box error"}


@dataclass
class HubPanel:
    repo: gr.Textbox
    push: gr.Button
    message: gr.HTML


def build() -> HubPanel:
    with gr.Accordion("Upload to the Hugging Face Hub", open=False, elem_id="hub-accordion"):
        gr.HTML('<div class="hint">A done run\'s outputs, last samples and a model card, to a private repo (made if '
                'missing) with this machine\'s <code>HF_TOKEN</code>. Headless: <code>python launch.py --push-to-hub '
                'runs/&lt;name&gt; user/name</code>, or <code>output.push_to_hub</code> in the preset.</div>')
        with gr.Row(equal_height=True):
            repo = gr.Textbox(label="Repo id", placeholder="user/name", scale=2, elem_id="hub-repo")
            push = gr.Button("Upload", scale=1, min_width=120, elem_id="hub-push")
        message = gr.HTML("", elem_id="hub-message")
    return HubPanel(repo, push, message)


def message_html(ctx, name: str | None) -> str:
    try:
        status = ctx.hub.status(ctx.jobs.run_dir(name)) if name else None
    except UserError:
        status = None
    if status is None:
        return ""
    state, text = status
    return f'<div class="{_BOX[state]}">{html.escape(text)}</div>'


def wire(ctx, runs, p: HubPanel) -> None:
    def push(name, repo):
        try:
            if not name:
                raise UserError("Pick a run to upload.")
            ctx.hub.start(ctx.jobs.run_dir(name), repo, exposed=ctx.workspace.confined)
        except (UserError, OSError) as exc:
            return f'<div class="msg-box error">{html.escape(str(exc))}</div>'
        return message_html(ctx, name)

    p.push.click(push, inputs=[runs.select, p.repo], outputs=[p.message], api_name="push_to_hub")

    def tick(name, shown):
        now = message_html(ctx, name)
        return gr.skip() if now == shown else now

    runs.timer.tick(tick, inputs=[runs.select, p.message], outputs=[p.message], show_progress="hidden",
                    trigger_mode="once", queue=False)
    runs.select.change(lambda name: message_html(ctx, name), inputs=[runs.select], outputs=[p.message],
                       show_progress="hidden")
