"""The "Dataset check" tab: point at a folder, see what training will see before a run starts."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from app import ui_captions
from app.dataset_check import check_dataset, filled


@dataclass
class DatasetTab:
    path: gr.Textbox
    instance_prompt: gr.Textbox
    caption_extension: gr.Textbox
    resolution: gr.Number
    check: gr.Button
    summary: gr.Markdown
    problems: gr.HTML
    gallery: gr.Gallery
    captions: ui_captions.CaptionTools


def build(ctx) -> DatasetTab:
    gr.Markdown("Check a folder of training images the way a run will read it: how many images, their sizes, "
                "kohya repeat folders, captions, and the files that would be skipped.", elem_classes=["tab-intro"])
    with gr.Row(equal_height=False):
        # Left empty, each field is the New run tab's setting: the check reads the folder as that run would.
        path = gr.Textbox(label="Images folder (data.path)", scale=3, elem_id="dataset-path",
                          placeholder="empty: the New run tab's data.path  (or /path/to/my/photos, demo://demo-data)")
        instance_prompt = gr.Textbox(label="Instance prompt (data.instance_prompt)", scale=2,
                                     info="Caption for images that have none.", elem_id="dataset-prompt")
        caption_extension = gr.Textbox("", label="Caption extension", scale=1, elem_id="dataset-ext",
                                       placeholder="empty: the run's")
        resolution = gr.Number(None, precision=0, label="Resolution", scale=1, elem_id="dataset-resolution",
                               info="empty: the New run tab's data.resolution")
    check = gr.Button("Check images", variant="primary", elem_id="dataset-check-button")
    problems = gr.HTML("", elem_id="dataset-problems")
    summary = gr.Markdown("", elem_id="dataset-summary")
    gallery = gr.Gallery(label="Images and their captions", columns=6, height=520, object_fit="cover",
                         elem_id="dataset-gallery")
    captions = ui_captions.build(ctx)
    return DatasetTab(path, instance_prompt, caption_extension, resolution, check, summary, problems, gallery, captions)


def run_check(ctx, path, prompt, extension, resolution, values: dict | None = None):
    path, prompt, extension, resolution = filled(path, prompt, extension, resolution, values)
    report = check_dataset(path, prompt, extension, resolution, ctx.workspace, ctx.jobs.demo_path)
    return report.summary_md, report.problems_html, report.gallery or None


def inputs_of(t: DatasetTab) -> list:
    return [t.path, t.instance_prompt, t.caption_extension, t.resolution]


def outputs_of(t: DatasetTab) -> list:
    return [t.summary, t.problems, t.gallery]


def wire(ctx, t: DatasetTab, run_values: gr.State) -> None:
    """`run_values`: the New run tab's values, for the fields left empty."""
    def handler(*args):
        return run_check(ctx, *args)

    inputs = [*inputs_of(t), run_values]
    t.check.click(handler, inputs=inputs, outputs=outputs_of(t), api_name="check_dataset")
    t.path.submit(handler, inputs=inputs, outputs=outputs_of(t))
    ui_captions.wire(ctx, t.captions, t.path, t.caption_extension)
