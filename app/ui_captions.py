"""The Dataset tab's caption tools: auto-caption the folder (app.caption_job: `launch.py --caption` in a process of
its own, its progress polled), edit each caption next to its thumbnail (saved when the box loses focus), and
change many captions at once (replace text, add or remove a tag) after a preview of what would change."""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr

from app import captions as C
from app.caption_job import CaptionRequest
from app.dataset_check import _thumb
from trainer.captioning.registry import CAPTIONERS, DEFAULT_CAPTIONER
from trainer.errors import UserError

POLL_S = 1.0


@dataclass
class CaptionTools:
    captioner: gr.Dropdown
    instruction: gr.Textbox
    prefix: gr.Textbox
    threshold: gr.Number
    overwrite: gr.Checkbox
    start: gr.Button
    stop: gr.Button
    status: gr.Markdown
    timer: gr.Timer
    load: gr.Button
    message: gr.HTML
    items: gr.State
    operation: gr.Radio
    find: gr.Textbox
    replacement: gr.Textbox
    preview: gr.Button
    apply: gr.Button
    pending: gr.State
    changes: gr.HTML


def _msg(kind: str, text: str) -> str:
    return f'<div class="msg-box {kind}">{html.escape(text)}</div>'


def build(ctx) -> CaptionTools:
    with gr.Accordion("Auto-caption this folder", open=False, elem_id="caption-accordion"):
        with gr.Row():
            captioner = gr.Dropdown([(f"{n}: {s.about}", n) for n, s in CAPTIONERS.items()], value=DEFAULT_CAPTIONER,
                                    allow_custom_value=True, label="Captioner (or a model folder, or a hub id owner/name)",
                                    scale=3, elem_id="caption-model")
            prefix = gr.Textbox(label="Prefix (trigger word)", placeholder="sks, ", scale=1, elem_id="caption-prefix")
            threshold = gr.Number(0.35, label="Tag threshold (taggers)", minimum=0.01, maximum=0.99, scale=1,
                                  elem_id="caption-threshold")
        instruction = gr.Textbox(label="Instruction (chat captioners; Florence-2: its task token)", lines=2,
                                 placeholder="empty: the captioner's own", elem_id="caption-instruction")
        with gr.Row():
            overwrite = gr.Checkbox(False, label="Overwrite existing captions", elem_id="caption-overwrite")
            start = gr.Button("Caption images", variant="primary", elem_id="caption-start")
            stop = gr.Button("Stop", variant="stop", elem_id="caption-stop")
        status = gr.Markdown("", elem_id="caption-status")
    gr.Markdown("### Captions", elem_id="captions-title")
    with gr.Row():
        load = gr.Button("Load captions for editing", elem_id="captions-load")
    message = gr.HTML("", elem_id="captions-message")
    with gr.Row(equal_height=False):
        operation = gr.Radio(list(C.OPERATIONS), value=C.OPERATIONS[0], label="Change every caption",
                             elem_id="captions-operation")
        find = gr.Textbox(label="Find (or the tag)", elem_id="captions-find")
        replacement = gr.Textbox(label="Replace with", elem_id="captions-replace")
        preview = gr.Button("Preview", elem_id="captions-preview")
        apply = gr.Button("Apply", variant="primary", interactive=False, elem_id="captions-apply")
    changes = gr.HTML("", elem_id="captions-changes")
    items = gr.State([])
    return CaptionTools(captioner, instruction, prefix, threshold, overwrite, start, stop, status, gr.Timer(POLL_S),
                        load, message, items, operation, find, replacement, preview, apply, gr.State([]), changes)


def wire(ctx, t: CaptionTools, folder: gr.Textbox, extension: gr.Textbox) -> None:
    """`folder` and `extension` are the Dataset tab's own fields (data.path, data.caption_extension)."""
    job = ctx.captions

    def start_captioning(path, ext, captioner, instruction, prefix, threshold, overwrite):
        try:  # the threshold only matters to a tagger; the others ignore it
            job.start(CaptionRequest(path, captioner, prefix or "", bool(overwrite), instruction or "",
                                     float(threshold) if threshold else None, ext or ".txt"))
        except (UserError, OSError) as exc:  # OSError: the process could not be started
            return f"**Not started:** {exc}"
        return "Starting: loading the captioner"

    t.start.click(start_captioning, inputs=[folder, extension, t.captioner, t.instruction, t.prefix, t.threshold, t.overwrite],
                  outputs=[t.status])
    t.stop.click(lambda: job.stop(), outputs=[])
    t.timer.tick(lambda: job.status() or gr.skip(), outputs=[t.status])

    def load_captions(path, ext):
        try:
            folder_path = C.folder_of(ctx.workspace, path)
            found = C.captions_of(folder_path, C.caption_extension(ext))
        except UserError as exc:
            return [], _msg("error", str(exc))
        shown = [(str(image.relative_to(folder_path)), str(image), caption) for image, caption in found[:C.EDIT_LIMIT]]
        more = f" (the first {C.EDIT_LIMIT} of {len(found)})" if len(found) > C.EDIT_LIMIT else ""
        missing = sum(1 for _, caption in found if not caption)
        return shown, _msg("ok", f"{len(found)} images{more}, {missing} without a caption. A caption is saved when "
                                 "you leave its box.")

    t.load.click(load_captions, inputs=[folder, extension], outputs=[t.items, t.message])

    @gr.render(inputs=[t.items])
    def editor(items):
        with gr.Column(elem_id="captions-editor"):
            for i, (rel, image, caption) in enumerate(items):
                with gr.Row(equal_height=True, elem_classes=["caption-row"]):
                    gr.Image(_thumb(image), show_label=False, height=96, width=96, scale=0, min_width=100,
                             interactive=False, container=False)
                    box = gr.Textbox(caption, label=rel, lines=2, scale=5, interactive=True, elem_id=f"caption-edit-{i}",
                                     elem_classes=["caption-edit"])

                    def save_caption(text, path, ext, rel=rel):
                        try:
                            C.save_caption(ctx.workspace, path, rel, text, ext)
                        except (UserError, OSError) as exc:
                            return _msg("error", f"{rel}: not saved: {exc}")
                        return _msg("ok", f"Saved {rel}.")

                    box.blur(save_caption, inputs=[box, folder, extension], outputs=[t.message])

    def preview_caption_change(path, ext, operation, find, replacement):
        try:
            changes = C.preview(C.folder_of(ctx.workspace, path), operation, find or "", replacement or "", ext)
        except UserError as exc:
            return [], _msg("error", str(exc)), gr.update(interactive=False)
        if not changes:
            return [], _msg("warning", "No caption would change."), gr.update(interactive=False)
        rows = "".join(f"<tr><td>{html.escape(c.image.name)}</td><td>{html.escape(c.before)}</td>"
                       f"<td>{html.escape(c.after)}</td></tr>" for c in changes[:20])
        head = f"<b>{len(changes)} caption{'s' if len(changes) != 1 else ''} will change.</b> Press Apply to write them."
        return (changes, f'<div class="msg-box warning">{head}<table><tr><th>image</th><th>before</th><th>after</th>'
                f"</tr>{rows}</table></div>", gr.update(interactive=True))

    t.preview.click(preview_caption_change, inputs=[folder, extension, t.operation, t.find, t.replacement],
                    outputs=[t.pending, t.changes, t.apply])

    def apply_caption_change(pending, path, ext):
        written, skipped = C.apply(pending)
        note = f" ({skipped} changed since the preview: left alone)" if skipped else ""
        shown, listing = load_captions(path, ext)
        return [], _msg("ok", f"Changed {written} caption{'s' if written != 1 else ''}{note}."), \
            gr.update(interactive=False), shown

    t.apply.click(apply_caption_change, inputs=[t.pending, folder, extension], outputs=[t.pending, t.changes, t.apply, t.items])
