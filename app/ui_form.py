"""Gradio widgets for the generated settings form (app.forms says what each key is; this draws it)."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import gradio as gr

from trainer.families import SPECS

from app.forms import (
    ADVANCED,
    DEVICE_CHOICES,
    GROUPS,
    TRISTATE,
    FieldSpec,
    grouped,
    to_widget,
)

# Sub-panels of a group, by schema section (title); the section's keys go in that panel. A family's own section
# (its spec's `section`) gets a panel too, open for its families (and when a preset of that family is chosen).
SUBPANELS = {
    "lora": "LoRA",
    "full": "Full fine-tune",
    "prior": "Prior preservation (DreamBooth class images)",
    **{spec.section: spec.section_title for spec in SPECS.values() if spec.section},
}
PANEL_FAMILIES = {section: tuple(name for name, spec in SPECS.items() if spec.section == section)
                  for section in {spec.section for spec in SPECS.values() if spec.section}}
WIDE_KINDS = ("lines",)
PER_ROW = 3


@dataclass
class FormWidgets:
    fields: dict[str, gr.components.Component] = field(default_factory=dict)
    errors: dict[str, gr.Markdown] = field(default_factory=dict)
    panels: dict[str, gr.Column] = field(default_factory=dict)  # "lora" / "full": shown for that method
    accordions: list[tuple[gr.Accordion, list[str]]] = field(default_factory=list)  # collapsed keys
    family_panels: list[tuple[gr.Accordion, tuple[str, ...]]] = field(default_factory=list)


def widget(spec: FieldSpec, value) -> gr.components.Component:
    label = spec.label if spec.label.lower() == spec.key.replace("_", " ") else f"{spec.label} ({spec.key})"
    common = dict(label=label, info=spec.help or None, elem_id=spec.elem_id, value=to_widget(spec, value),
                  interactive=True)
    if spec.kind == "bool":
        return gr.Checkbox(**common)
    if spec.kind == "tristate":
        return gr.Dropdown(choices=list(TRISTATE), **common)
    if spec.kind == "choice":
        return gr.Dropdown(choices=list(spec.choices or ()), **common)
    if spec.kind == "int":
        return gr.Number(precision=0, **common)
    if spec.key == "devices":
        return gr.Dropdown(choices=DEVICE_CHOICES + ["1", "2", "4", "8"], allow_custom_value=True, **common)
    if spec.kind == "lines":
        return gr.Textbox(lines=3, max_lines=12, **common)
    return gr.Textbox(lines=1, max_lines=1, **common)


def _field(spec: FieldSpec, values: dict, out: FormWidgets) -> None:
    with gr.Column(min_width=220, elem_classes=["field"]):
        out.fields[spec.key] = widget(spec, values.get(spec.key))
        out.errors[spec.key] = gr.Markdown("", visible=False, elem_id=spec.error_id, elem_classes=["field-error"])


def _rows(specs: list[FieldSpec], values: dict, out: FormWidgets) -> None:
    row: list[FieldSpec] = []

    def flush():
        if row:
            with gr.Row(equal_height=False):
                for s in row:
                    _field(s, values, out)
            row.clear()

    for spec in specs:
        if spec.kind in WIDE_KINDS:
            flush()
            row.append(spec)
            flush()
            continue
        row.append(spec)
        if len(row) == PER_ROW:
            flush()
    flush()


def _fields(specs: list[FieldSpec], values: dict, out: FormWidgets, more_title: str) -> None:
    """The main fields in rows, the advanced ones in a closed accordion (opened when one of them has an error)."""
    _rows([s for s in specs if s.key not in ADVANCED], values, out)
    advanced = [s for s in specs if s.key in ADVANCED]
    if advanced:
        with gr.Accordion(more_title, open=False, elem_classes=["more"]) as accordion:
            _rows(advanced, values, out)
        out.accordions.append((accordion, [s.key for s in advanced]))


def build_form(values: dict) -> FormWidgets:
    """The whole form, group by group, with the values of `values`."""
    out = FormWidgets()
    method = values.get("method")
    for group, specs in grouped().items():
        title, blurb = GROUPS.get(group, (group.capitalize(), ""))
        with gr.Column(elem_classes=["form-group"], elem_id=f"group-{group}"):
            gr.HTML(f'<div class="group-title">{html.escape(title)}</div>'
                    f'<div class="group-blurb">{html.escape(blurb)}</div>')
            sections: dict[str, list[FieldSpec]] = {}
            for spec in specs:
                head = spec.key.split(".", 1)[0]
                sections.setdefault(head if "." in spec.key and head in SUBPANELS else "", []).append(spec)
            _fields(sections.pop("", []), values, out, f"More {title.lower()} settings")
            for section, sub in sections.items():
                title = SUBPANELS[section]
                if section in ("lora", "full"):
                    with gr.Column(visible=(method == section), elem_classes=["subpanel"]) as panel:
                        gr.HTML(f'<div class="subpanel-title">{html.escape(title)}</div>')
                        _fields(sub, values, out, f"More {title} settings")
                    out.panels[section] = panel
                else:
                    families = PANEL_FAMILIES.get(section, ())
                    is_open = bool(values.get(f"{section}.enabled")) or values.get("model.family") in families
                    with gr.Accordion(title, open=is_open, elem_classes=["subpanel"]) as accordion:
                        _rows(sub, values, out)
                    out.accordions.append((accordion, [s.key for s in sub]))
                    if families:
                        out.family_panels.append((accordion, families))
    return out
