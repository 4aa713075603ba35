"""The Runs tab's "Outputs from a checkpoint" panel: pick a checkpoint of the selected run, export it (the files a
finished run writes, into output/step-NNNNNN/: app.exports runs `launch.py --export`), download them, and see
what loads each output file. Refreshed on the Runs tab's timer when the run's checkpoints or outputs change, and
when a checkpoint is picked; its own outputs, so the Runs tab's render list does not grow."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from app.exports import export_files, labels_html
from trainer.core.checkpoint import complete_checkpoints
from trainer.core.outputs import export_dir, exported_steps
from trainer.core.runfolder import RunFolder
from trainer.errors import UserError


@dataclass
class ExportPanel:
    checkpoint: gr.Dropdown
    export: gr.Button
    message: gr.HTML
    files: gr.File
    labels: gr.HTML
    shown: gr.State  # the fingerprint of what the panel shows


def build() -> ExportPanel:
    with gr.Accordion("Outputs from a checkpoint", open=True, elem_id="export-accordion"):
        gr.HTML('<div class="hint">A stopped or killed run has checkpoints but no outputs: export any checkpoint to '
                'the files a finished run writes (LoRA for diffusers and ComfyUI / A1111 / Forge, or the full model). '
                'Headless: <code>python launch.py --export RUN --step N</code>; <code>checkpoint.export: true</code> '
                'writes them at every checkpoint.</div>')
        with gr.Row(equal_height=True):
            checkpoint = gr.Dropdown(choices=[], value=None, label="Checkpoint", interactive=True, scale=2,
                                     elem_id="export-step")
            export = gr.Button("Export outputs", interactive=False, elem_id="export-button", scale=1, min_width=140)
        message = gr.HTML("", elem_id="export-message")
        files = gr.File(label="Exported files: download", file_count="multiple", visible=False, interactive=False,
                        elem_id="export-files")
        labels = gr.HTML("", elem_id="output-labels")
    return ExportPanel(checkpoint, export, message, files, labels, gr.State(""))


def _run_dir(ctx, name: str | None) -> Path | None:
    try:
        return ctx.jobs.run_dir(name) if name else None
    except UserError:
        return None


def view(ctx, name: str | None, step) -> list:
    """Updates for (checkpoint, export, files, labels) showing run `name`, keeping the chosen step if it is still
    there (else the newest checkpoint)."""
    run_dir = _run_dir(ctx, name)
    steps = [c.step for c in complete_checkpoints(run_dir)] if run_dir else []
    if not steps:
        return [gr.update(choices=[], value=None), gr.update(interactive=False, value="Export outputs"),
                gr.update(value=None, visible=False), labels_for(run_dir, None)]
    assert run_dir is not None
    done = set(exported_steps(run_dir))
    step = int(step) if step is not None and int(step) in steps else steps[-1]
    choices = [(f"step {s}" + (" · exported" if s in done else ""), s) for s in reversed(steps)]
    files = [str(p) for p in export_files(run_dir, step)]
    return [gr.update(choices=choices, value=step),
            gr.update(interactive=True, value=f"Export step {step}" + (" again" if step in done else "")),
            gr.update(value=files or None, visible=bool(files)), labels_for(run_dir, step)]


def labels_for(run_dir: Path | None, step: int | None) -> str:
    """What loads each output: the finished run's (output/) and the chosen checkpoint's export."""
    if run_dir is None:
        return ""
    paths = []
    output = RunFolder(run_dir).output
    if output.is_dir():
        paths += sorted(p for p in output.iterdir() if not p.name.startswith((".", "step-")))
    if step is not None and export_dir(run_dir, step).is_dir():
        paths += sorted(export_dir(run_dir, step).iterdir())
    return labels_html(run_dir, paths)


def fingerprint(ctx, name: str | None) -> str:
    """Changes when what the panel shows could have: another run, a checkpoint or an export written. Stats only."""
    run_dir = _run_dir(ctx, name)
    if run_dir is None:
        return ""
    folder = RunFolder(run_dir)
    stamps = []
    for path in (folder.checkpoints, folder.output):
        try:
            stamps.append(path.stat().st_mtime_ns)
        except OSError:
            stamps.append(0)
    return f"{name}:{stamps}"


def wire(ctx, runs, p: ExportPanel) -> None:
    outs = [p.checkpoint, p.export, p.files, p.labels]

    def tick(name, step, shown):
        now = fingerprint(ctx, name)
        if now == shown:
            return [gr.skip()] * (len(outs) + 1)
        return [*view(ctx, name, step), now]

    # On the Runs tab's timer, re-rendered only when the run's checkpoints/ or output/ changed (an export renames
    # its folder into output/, which changes output/'s mtime), like the tab itself (app.ui_runs.tick).
    runs.timer.tick(tick, inputs=[runs.select, p.checkpoint, p.shown], outputs=[*outs, p.shown],
                    show_progress="hidden", trigger_mode="once", queue=False)
    p.checkpoint.input(lambda name, step: view(ctx, name, step), inputs=[runs.select, p.checkpoint], outputs=outs,
                       show_progress="hidden")

    def start(name, step):
        try:
            if step is None:
                raise UserError("Pick a checkpoint to export.")
            ctx.exports.start(ctx.jobs.run_dir(name), int(step))
        except (UserError, OSError) as exc:
            return f'<div class="msg-box error">{html.escape(str(exc))}</div>'
        return (f'<div class="msg-box ok">Exporting step {int(step)} of {html.escape(name)}: the model loads, then '
                'the files appear here (its lines are in the log).</div>')

    p.export.click(start, inputs=[runs.select, p.checkpoint], outputs=[p.message], api_name="export")
