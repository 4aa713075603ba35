"""The Runs tab's "Generate" panel: try a checkpoint of the selected run before downloading it. One prompt, seed,
steps, guidance and LoRA scale; the base alone beside the base with the chosen checkpoint's weights (app.generations
runs trainer.engine.generate in a process of its own, queued behind a training on the same GPUs, at once on the
CPU for the demo models). Its checkpoint list follows the Export panel's refresh."""

from __future__ import annotations

import html
import queue
import threading
from dataclasses import dataclass

import gradio as gr

from app.generations import Generations, Request, result_of
from trainer.core.checkpoint import complete_checkpoints
from trainer.errors import UserError


@dataclass
class GeneratePanel:
    accordion: gr.Accordion
    checkpoint: gr.Dropdown
    prompt: gr.Textbox
    seed: gr.Number
    steps: gr.Number
    guidance: gr.Number
    scale: gr.Slider
    go: gr.Button
    message: gr.HTML
    base: gr.Image
    tuned: gr.Image


def build() -> GeneratePanel:
    with gr.Accordion("Generate: try a checkpoint", open=False, elem_id="generate-accordion") as accordion:
        gr.HTML('<div class="hint">The base model alone beside the base with a checkpoint\'s weights, same prompt '
                'and seed. It loads the model in a process of its own on the devices the run trained on (the CPU '
                'for the demo models), once no training holds them.</div>')
        with gr.Row(equal_height=True):
            checkpoint = gr.Dropdown(choices=[], value=None, label="Checkpoint", interactive=True, scale=1,
                                     elem_id="generate-step")
            prompt = gr.Textbox(label="Prompt", scale=3, elem_id="generate-prompt",
                                placeholder="empty: the run's first sample prompt")
        with gr.Row(equal_height=True):
            seed = gr.Number(0, precision=0, label="Seed", minimum=0, elem_id="generate-seed")
            steps = gr.Number(25, precision=0, label="Steps", minimum=1, maximum=200, elem_id="generate-steps")
            guidance = gr.Number(7.5, label="Guidance", minimum=0, maximum=30, elem_id="generate-guidance")
            scale = gr.Slider(0, 2, value=1.0, step=0.05, label="LoRA scale (0: the base)", elem_id="generate-scale")
            go = gr.Button("Generate", variant="primary", elem_id="generate-button", min_width=120)
        message = gr.HTML("", elem_id="generate-message")
        with gr.Row():
            base = gr.Image(label="base alone", interactive=False, elem_id="generate-base", height=320)
            tuned = gr.Image(label="base + checkpoint", interactive=False, elem_id="generate-tuned", height=320)
    return GeneratePanel(accordion, checkpoint, prompt, seed, steps, guidance, scale, go, message, base, tuned)


def steps_of(ctx, name: str | None) -> list[int]:
    try:
        return [c.step for c in complete_checkpoints(ctx.jobs.run_dir(name))] if name else []
    except UserError:
        return []


def choices(ctx, name: str | None, chosen) -> dict:
    steps = steps_of(ctx, name)
    keep = int(chosen) if chosen is not None and int(chosen) in steps else (steps[-1] if steps else None)
    return gr.update(choices=[(f"step {s}", s) for s in reversed(steps)], value=keep)


def first_prompt(ctx, name: str) -> str:
    from app import runs as R

    view = R.read_run(ctx.jobs.run_dir(name))
    return next((e.prompt for _, e in sorted(view.samples.items()) if e.prompt), "")


def info(text: str) -> str:
    return f'<div class="msg-box info generate-progress">{html.escape(text)}</div>'


def error(exc: Exception) -> str:
    return f'<div class="msg-box error">{html.escape(str(exc))}</div>'


def wire(ctx, runs, p: GeneratePanel) -> None:
    generations = Generations(ctx.jobs.runs_dir)
    # The checkpoint list: when a run is chosen and when the panel opens (not on every poll: the panel is closed
    # most of the time).
    for event in (runs.select.change, p.accordion.expand):
        event(lambda name, chosen: choices(ctx, name, chosen), inputs=[runs.select, p.checkpoint],
              outputs=[p.checkpoint], show_progress="hidden")

    def generate(name, step, prompt, seed, steps, guidance, scale):
        """Yields (message, base, tuned): what it waits for, then the process's progress, then the images."""
        try:
            if step is None:
                raise UserError("This run has no checkpoint yet: generate once it has saved one.")
            run_dir = ctx.jobs.run_dir(name)
            request = Request(int(step), prompt or first_prompt(ctx, name), seed, steps, guidance, scale).checked()
        except (UserError, OSError, TypeError, ValueError) as exc:
            yield error(exc), gr.skip(), gr.skip()
            return
        lines: queue.Queue = queue.Queue()
        done: list = []

        def work() -> None:
            try:
                done.append(generations.run(run_dir, request, say=lines.put))
            except Exception as exc:  # shown in the panel (a UserError says what to do), never a hung panel
                done.append(exc)
            finally:
                lines.put(None)  # the end

        threading.Thread(target=work, daemon=True, name=f"generate-{name}").start()
        yield info(f"Generating step {request.step}…"), gr.skip(), gr.skip()
        while (line := lines.get()) is not None:
            yield info(line), gr.skip(), gr.skip()
        if isinstance(done[0], Exception):
            yield error(done[0]), gr.skip(), gr.skip()
            return
        out = done[0]
        result = result_of(out)
        note = (f'<div class="msg-box ok">Step {result["step"]} at LoRA scale {result["scale"]:g}, seed '
                f'{result["seed"]}, {result["steps"]} steps, guidance {result["guidance"]:g} on {result["device"]}: '
                f'{html.escape(result["prompt"])}</div>')
        yield note, str(out / "base.png"), str(out / "tuned.png")

    p.go.click(generate, inputs=[runs.select, p.checkpoint, p.prompt, p.seed, p.steps, p.guidance, p.scale],
               outputs=[p.message, p.base, p.tuned], api_name="generate", concurrency_limit=2)
