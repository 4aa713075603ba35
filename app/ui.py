"""The page: a header, three tabs (New run, Runs, Dataset check) and the wiring between them."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr

from app import runs as R
from app import ui_dataset, ui_export, ui_generate, ui_hub, ui_queue, ui_runs, ui_train
from app.checks import check_values
from app.caption_job import CaptionJob
from app.exports import Exports
from app.hub_uploads import HubUploads
from app.jobs import HardwareCache, Jobs
from app.presets import Presets
from app.security import Workspace
from trainer.errors import UserError

CSS_PATH = Path(__file__).with_name("style.css")
# System fonts: the UI works offline (the default theme would fetch its fonts from Google).
THEME = gr.themes.Default(primary_hue="indigo", neutral_hue="slate",
                          font=["ui-sans-serif", "system-ui", "Segoe UI", "Helvetica", "Arial", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"])


@dataclass
class AppContext:
    runs_dir: Path
    presets: Presets
    hardware: HardwareCache
    jobs: Jobs
    workspace: Workspace
    blocks: gr.Blocks | None = field(default=None)
    login: bool = False  # the UI has a login: show a way out of it
    exports: Exports = field(default_factory=Exports)  # `launch.py --export` processes the Runs tab started
    hub: HubUploads = field(default_factory=HubUploads)  # `launch.py --push-to-hub` processes it started
    captions: CaptionJob | None = None  # the Dataset tab's `launch.py --caption` process (made with the workspace)

    def __post_init__(self) -> None:
        if self.captions is None:
            self.captions = CaptionJob(self.workspace)


def header_html(hardware_text: str) -> str:
    return (f'<div id="app-header"><div class="title">imagetune</div>'
            f'<div class="subtitle">Fine-tune image models: pick a preset, press Start, watch it learn.</div>'
            f'<div class="hw" id="hardware-line">{html.escape(hardware_text)}</div></div>')


def build_ui(ctx: AppContext) -> gr.Blocks:
    with gr.Blocks(title="imagetune", analytics_enabled=False, delete_cache=(3600, 24 * 3600)) as blocks:
        ctx.blocks = blocks
        with gr.Row(elem_id="header-row"):
            header = gr.HTML(header_html(ctx.hardware.describe()), scale=9)
            if ctx.login:  # Gradio's /logout forgets this browser's session token and cookie
                gr.Button("Log out", link="/logout", size="sm", scale=0, min_width=90, elem_id="logout-button")
        with gr.Tabs(selected="train", elem_id="tabs") as tabs:
            with gr.Tab("New run", id="train", elem_id="tab-train"):
                train = ui_train.build(ctx)
            with gr.Tab("Runs", id="runs", elem_id="tab-runs"):
                queued = ui_queue.build()
                runs = ui_runs.build(ctx)
                export = ui_export.build()
                hub = ui_hub.build()
                generate = ui_generate.build()
            with gr.Tab("Dataset check", id="dataset", elem_id="tab-dataset"):
                dataset = ui_dataset.build(ctx)
        ui_train.wire(ctx, train)
        ui_runs.wire(ctx, runs, tabs)
        ui_export.wire(ctx, runs, export)
        ui_hub.wire(ctx, runs, hub)
        ui_generate.wire(ctx, runs, generate)
        ui_queue.wire(ctx, runs, queued)
        ui_dataset.wire(ctx, dataset, train.values)
        _wire_start(ctx, train, runs, tabs)
        _wire_check_data(ctx, train, dataset, tabs)

        def hardware_header():
            try:
                ctx.hardware.get(180)
            except Exception:
                pass
            return header_html(ctx.hardware.describe())

        blocks.load(hardware_header, outputs=[header], show_progress="hidden")
    return blocks


def _wire_start(ctx: AppContext, train: ui_train.TrainTab, runs: ui_runs.RunsTab, tabs: gr.Tabs) -> None:
    def on_start(values):
        check = check_values(values, lambda config: ctx.hardware.for_config(config, wait=300), ctx.workspace)
        if check.ok:
            try:
                run_dir = ctx.jobs.start(check.config)
            except UserError as exc:
                check.add(str(exc))
            else:
                if not isinstance(run_dir, Path):  # queued: a run holds the machine, or others wait before it
                    message = (f'<div class="msg-box ok">Queued <b>{html.escape(run_dir.name)}</b> as '
                               f'#{run_dir.position}: it starts when the runs before it have ended (the '
                               f'<b>Runs</b> tab lists it, and can cancel it).</div>')
                    return message, ui_train.problems_html(check), gr.skip(), gr.skip(), gr.skip()
                names = [v.name for v in R.list_runs(ctx.runs_dir)]
                message = (f'<div class="msg-box ok">Started <b>{html.escape(run_dir.name)}</b>. '
                           f'It is followed in the <b>Runs</b> tab.</div>')
                return message, ui_train.problems_html(check), gr.Tabs(selected="runs"), \
                    gr.update(choices=names, value=run_dir.name), {}
        n = check.problem_count
        message = (f'<div class="msg-box error">Not started: {n} problem{"s" if n != 1 else ""} to fix first '
                   f'(marked in red).</div>' if n else
                   '<div class="msg-box error">Not started: the plan is not ready yet; try again in a moment.</div>')
        return message, ui_train.problems_html(check), gr.skip(), gr.skip(), gr.skip()

    train.start.click(on_start, inputs=[train.values],
                      outputs=[train.start_msg, train.problems, tabs, runs.select, runs.seen], **ui_train.FORM_QUEUE).then(
        lambda name, seen: ui_runs.render(ui_runs.snapshot(ctx, name), seen or {}),
        inputs=[runs.select, runs.seen], outputs=ui_runs.outputs_of(runs), show_progress="hidden")


def _wire_check_data(ctx: AppContext, train: ui_train.TrainTab, dataset: ui_dataset.DatasetTab, tabs: gr.Tabs) -> None:
    def copy(values):
        return (values.get("data.path") or "", values.get("data.instance_prompt") or "",
                values.get("data.caption_extension") or ".txt", values.get("data.resolution"), gr.Tabs(selected="dataset"))

    inputs = ui_dataset.inputs_of(dataset)
    train.check_data.click(copy, inputs=[train.values], outputs=[*inputs, tabs]).then(
        lambda *a: ui_dataset.run_check(ctx, *a), inputs=inputs, outputs=ui_dataset.outputs_of(dataset))


def make_context(runs_dir: str | Path, home: str | Path | None, workspace: Workspace,
                 hardware: HardwareCache | None = None) -> AppContext:
    from app.presets import default_home

    runs_dir = Path(runs_dir).expanduser().resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    hardware = hardware or HardwareCache()
    jobs = Jobs(runs_dir, hardware, workspace)
    return AppContext(runs_dir, Presets(default_home(home) / "presets"), hardware, jobs, workspace)
