"""The "New run" tab: preset list, the generated form, the YAML kept in sync, validation at each field, the plan
line, Start, and save as a preset."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TypedDict

import gradio as gr

from app import forms
from app.checks import Check, check_values
from app.forms import FORM_KEYS, SPEC
from app.imports import import_upload
from app.presets import DEFAULT_PRESET
from app.ui_form import FormWidgets, build_form
from trainer.errors import UserError

class EventQueue(TypedDict):
    concurrency_id: str
    concurrency_limit: int


# The form's events (fields, YAML, preset, save, Start) run one at a time, in the order they were sent (one queue
# for the whole app: it is a single-user tool), so each reads the settings state the previous one wrote.
FORM_QUEUE = EventQueue(concurrency_id="form", concurrency_limit=1)


@dataclass
class TrainTab:
    preset: gr.Dropdown
    description: gr.Markdown
    form: FormWidgets
    yaml: gr.Code
    yaml_msg: gr.HTML
    values: gr.State
    shown_errors: gr.State
    plan: gr.HTML
    problems: gr.HTML
    start: gr.Button
    start_msg: gr.HTML
    save_name: gr.Textbox
    save: gr.Button
    save_msg: gr.HTML
    check_data: gr.Button
    import_file: gr.File
    import_name: gr.Textbox
    import_button: gr.Button
    import_msg: gr.HTML


def user_edits(widget) -> tuple[list, list]:
    """(events carrying the widget's value, `.select` events carrying it in their SelectData): see wire()."""
    if isinstance(widget, gr.Textbox):
        return [widget.input, widget.blur, widget.submit], []
    if isinstance(widget, gr.Number):
        return [widget.input, widget.submit], []
    if isinstance(widget, gr.Dropdown) and widget.allow_custom_value:
        return [widget.change], [widget.select]
    return [], [widget.select]


def plan_html(check: Check, hardware_text: str) -> str:
    hw = f'<div class="plan-hw">{html.escape(hardware_text)}</div>' if check.waiting_for_hardware else ""
    if check.plan is not None:
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in check.plan.notes)
        memory = (f'<div class="plan-line" id="plan-memory">memory: {html.escape(check.plan.memory)}</div>'
                  if check.plan.memory else "")  # the estimate of trainer.core.memory
        return (f'<div class="plan ok"><div class="plan-label">Plan on this machine</div>'
                f'<div class="plan-line" id="plan-text">{html.escape(check.plan.line())}</div>{memory}'
                f'{f"<ul class=plan-notes>{notes}</ul>" if notes else ""}{hw}</div>')
    if check.waiting_for_hardware:
        why = "Checking this machine's GPUs…"
    else:
        why = "The plan appears once the settings are valid."
    return f'<div class="plan pending"><div class="plan-label">Plan</div><div class="plan-line" id="plan-text">{why}</div>{hw}</div>'


def problems_html(check: Check) -> str:
    if not check.problem_count:
        return ""
    items = [f"<li><b>{html.escape(k)}</b>: {html.escape(m)}</li>" for k, ms in check.field_errors.items() for m in ms]
    items += [f"<li>{html.escape(p)}</li>" for p in check.other_errors]
    n = check.problem_count
    return (f'<div class="msg-box error" id="problems-box"><b>{n} problem{"s" if n != 1 else ""} to fix before '
            f'starting</b> (marked in red next to the field):<ul>{"".join(items)}</ul></div>')


def build(ctx) -> TrainTab:
    values = ctx.presets.values(DEFAULT_PRESET)
    with gr.Row(elem_id="preset-row"):
        preset = gr.Dropdown(choices=ctx.presets.choices(), value=DEFAULT_PRESET, label="Preset", scale=1,
                             info="Start from a preset, change what you need below.", elem_id="preset",
                             interactive=True)
        description = gr.Markdown(ctx.presets.description(DEFAULT_PRESET), elem_id="preset-description")
    with gr.Row(equal_height=False):
        with gr.Column(scale=3, elem_id="form-column"):
            form = build_form(values)
            with gr.Accordion("Full config (YAML): every setting, in sync with the form", open=False,
                              elem_id="yaml-accordion"):
                yaml = gr.Code(forms.to_yaml(values), language="yaml", interactive=True, lines=18, max_lines=40,
                               elem_id="yaml-editor", show_label=False)
                yaml_msg = gr.HTML("")
        with gr.Column(scale=2, min_width=320, elem_id="side-panel"):
            plan = gr.HTML(plan_html(Check(), ctx.hardware.describe()), elem_id="plan-line")
            problems = gr.HTML("", elem_id="problems")
            start = gr.Button("▶  Start training", variant="primary", size="lg", elem_id="start-button")
            start_msg = gr.HTML("", elem_id="start-message")
            check_data = gr.Button("Check the training images first", size="sm", elem_id="check-data-button")
            with gr.Accordion("Save these settings as a new preset", open=False, elem_id="save-accordion"):
                save_name = gr.Textbox(label="Preset name", placeholder="my-dog-lora", elem_id="save-name")
                save = gr.Button("Save preset", size="sm", elem_id="save-button")
                save_msg = gr.HTML("")
            with gr.Accordion("Import a kohya_ss / sd-scripts / ai-toolkit config", open=False,
                              elem_id="import-accordion"):
                import_file = gr.File(label="Config file (.json, .toml, .yaml)", file_types=[".json", ".toml", ".yaml"],
                                      type="filepath", elem_id="import-file")
                import_name = gr.Textbox(label="Preset name", placeholder="the file's name", elem_id="import-name")
                import_button = gr.Button("Import as a preset", size="sm", elem_id="import-button")
                import_msg = gr.HTML("", elem_id="import-message")
    return TrainTab(preset, description, form, yaml, yaml_msg, gr.State(values), gr.State({}), plan, problems,
                    start, start_msg, save_name, save, save_msg, check_data, import_file, import_name, import_button,
                    import_msg)


def wire(ctx, t: TrainTab) -> None:
    fields = [t.form.fields[k] for k in FORM_KEYS]
    errors = [t.form.errors[k] for k in FORM_KEYS]
    panels = [t.form.panels[p] for p in ("lora", "full") if p in t.form.panels]
    panel_names = [p for p in ("lora", "full") if p in t.form.panels]

    def checked(values: dict) -> Check:
        return check_values(values, lambda config: ctx.hardware.for_config(config, wait=120), ctx.workspace)

    def feedback(values: dict, shown: dict, check: Check, new_preset: bool = False) -> list:
        """plan, problems, shown-errors state, one update per error slot (skipped when unchanged), panels."""
        out_errors, now = [], {}
        for key in FORM_KEYS:
            text = check.error_text(key)
            now[key] = text
            out_errors.append(gr.skip() if shown.get(key, "") == text else
                              gr.update(value="⚠ " + text.replace("\n", "  \n⚠ ") if text else "", visible=bool(text)))
        out_panels = [gr.update(visible=values.get("method") == name) for name in panel_names]
        # A collapsed panel opens when a field inside it gets an error (and is left as the user set it otherwise).
        family_open = {id(a): values.get("model.family") in fams for a, fams in t.form.family_panels}
        out_open = [gr.update(open=True) if any(now[k] and not shown.get(k) for k in keys) else
                    gr.update(open=family_open[id(a)]) if new_preset and id(a) in family_open else gr.skip()
                    for a, keys in t.form.accordions]
        return [plan_html(check, ctx.hardware.describe()), problems_html(check), now, *out_errors, *out_panels,
                *out_open]

    feedback_outputs = [t.plan, t.problems, t.shown_errors, *errors, *panels, *(a for a, _ in t.form.accordions)]

    # User edits only, so that a preset or the YAML editor setting many fields does not echo back as many events.
    # Gradio 6's `.input` of a Textbox can carry the text from before the last keystroke, so its `.blur` follows
    # with the final text; a dropdown's or checkbox's choice comes from its `.select` event data. Each event takes
    # only its own field's value, and all form events share one queue, so each reads the state the last one wrote.
    field_outputs = [t.values, t.yaml, t.yaml_msg, *feedback_outputs]

    def apply(key, values, shown, raw):
        value = forms.from_widget(SPEC[key], raw)
        if shown and key in values and values[key] == value:
            return [gr.skip()] * len(field_outputs)
        new = {**forms.without_yaml_error(values), key: value}  # the form rewrites the YAML whole
        return [new, forms.to_yaml(new), "", *feedback(new, shown, checked(new))]

    def on_value(key):
        return lambda values, shown, raw: apply(key, values, shown, raw)

    def on_select(key):
        def handler(values, shown, evt: gr.SelectData):
            return apply(key, values, shown, evt.value)
        return handler

    for key, widget in zip(FORM_KEYS, fields):
        with_value, with_select = user_edits(widget)
        common = dict(outputs=field_outputs, show_progress="hidden", trigger_mode="always_last", **FORM_QUEUE)
        if with_value:
            gr.on(with_value, on_value(key), inputs=[t.values, t.shown_errors, widget], **common)
        if with_select:
            gr.on(with_select, on_select(key), inputs=[t.values, t.shown_errors], **common)

    def field_updates(old: dict, new: dict) -> list:
        """Set the widgets whose value differs (the others are left alone, so typing in them is not disturbed)."""
        return [gr.skip() if k in old and old.get(k) == new.get(k) else
                gr.update(value=forms.to_widget(SPEC[k], new.get(k))) for k in FORM_KEYS]

    def on_yaml(text, values, shown):
        skip = [gr.skip()] * (len(feedback_outputs) + len(fields))
        try:
            new = forms.from_yaml(text)
        except forms.YamlError as exc:
            # Listed next to Start too (and Start refuses): the form's values stay as they were, but are not what
            # the editor says, so nothing may start from them.
            broken = forms.with_yaml_error(forms.without_yaml_error(values), str(exc))
            return [broken, f'<div class="msg-box error">{html.escape(str(exc))}</div>',
                    *feedback(broken, shown, checked(broken)), *[gr.skip()] * len(fields)]
        if new == values and shown:  # the form rewrote the YAML: already in sync
            return [gr.skip(), "", *skip]
        return [new, "", *feedback(new, shown, checked(new)), *field_updates(values, new)]

    gr.on([t.yaml.input, t.yaml.blur], on_yaml, inputs=[t.yaml, t.values, t.shown_errors],
          outputs=[t.values, t.yaml_msg, *feedback_outputs, *fields], show_progress="hidden",
          trigger_mode="always_last", **FORM_QUEUE)

    def on_preset(values, shown, evt: gr.SelectData):
        preset_id = evt.value
        try:
            new = ctx.presets.values(preset_id)
        except UserError as exc:
            return [gr.skip(), gr.skip(), gr.skip(), f'<div class="msg-box error">{html.escape(str(exc))}</div>',
                    *[gr.skip()] * (len(feedback_outputs) + len(fields))]
        return [new, ctx.presets.description(preset_id), forms.to_yaml(new), "",
                *feedback(new, shown, checked(new), new_preset=True), *field_updates({}, new)]

    t.preset.select(on_preset, inputs=[t.values, t.shown_errors],
                    outputs=[t.values, t.description, t.yaml, t.yaml_msg, *feedback_outputs, *fields], **FORM_QUEUE)

    def on_load(values, shown):
        return [gr.update(choices=ctx.presets.choices()), *feedback(values, shown, checked(values))]

    ctx.blocks.load(on_load, inputs=[t.values, t.shown_errors], outputs=[t.preset, *feedback_outputs],
                    show_progress="hidden", **FORM_QUEUE)

    def on_save(name, values):
        if values.get(forms.YAML_ERROR):
            return gr.skip(), f'<div class="msg-box error">Not saved: {html.escape(values[forms.YAML_ERROR])}</div>'
        try:
            preset_id = ctx.presets.save(name, values, ctx.workspace)
        except (UserError, OSError) as exc:
            return gr.skip(), f'<div class="msg-box error">{html.escape(str(exc))}</div>'
        where = ctx.presets.path(preset_id)
        return (gr.update(choices=ctx.presets.choices(), value=preset_id),
                f'<div class="msg-box ok">Saved as <b>{html.escape(preset_id.split("/", 1)[1])}</b> ({html.escape(str(where))}).</div>')

    t.save.click(on_save, inputs=[t.save_name, t.values], outputs=[t.preset, t.save_msg], **FORM_QUEUE)

    def on_import(upload, name):
        try:
            report = import_upload(ctx.presets, ctx.workspace, upload, name)
        except (UserError, OSError) as exc:
            return gr.skip(), f'<div class="msg-box error">{html.escape(str(exc))}</div>'
        return gr.update(choices=ctx.presets.choices()), report.html

    t.import_button.click(on_import, inputs=[t.import_file, t.import_name], outputs=[t.preset, t.import_msg],
                          **FORM_QUEUE)
