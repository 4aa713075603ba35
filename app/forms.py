"""The settings form, generated from `trainer.core.config.schema` so it never drifts from the engine.

Every schema key becomes a `FieldSpec` (its widget kind, label, help text, choices and the form group it belongs
to), except the keys that are only in the YAML editor (`version`, `distributed.*`). The UI holds the settings as
`values`: {dotted key: value} over every schema key (and any unknown key the user typed into the YAML, so that
validation can name it). This module converts between values, widget values and YAML; `app.checks` validates.
Nothing here imports gradio.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import MISSING, dataclass, is_dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf

from trainer.core.config.fields import help_of
from trainer.core.config.schema import Config, iter_keys
from trainer.families import SPECS as FAMILY_SPECS
from trainer.families import family_names

# Form groups, in page order: (title, what it is for). A key's group comes from its schema metadata `group`, else
# from its section (below), else it goes to "Other settings", so a new schema section still shows up.
GROUPS = {
    "model": ("Model", "The base model you fine-tune."),
    "data": ("Data", "Your training images and their captions."),
    "method": ("Method", "LoRA trains a small adapter file; a full fine-tune (DreamBooth) changes the model itself."),
    "training": ("Training", "How long and how fast it learns."),
    "batch": ("Batch and devices", "Where it runs, and how many images each optimizer step sees."),
    "precision": ("Precision", "Number formats and attention kernels."),
    "sampling": ("Sampling", "Preview images rendered during training, to watch it learn."),
    "output": ("Output and checkpoints", "The run's name, and how often its progress is saved."),
    "other": ("Other settings", "Settings of newer parts of the engine."),
}
SECTION_GROUP = {
    "model": "model", "data": "data", "method": "method", "lora": "method", "full": "method", "prior": "method",
    **{spec.section: "model" for spec in FAMILY_SPECS.values() if spec.section},  # a family's own section (flow, detection)
    "seed": "training", "train": "training", "devices": "batch", "batch": "batch", "hardware": "batch",
    "precision": "precision",
    "attention": "precision", "sample": "sampling", "name": "output", "checkpoint": "output", "eval": "output",
    "logging": "output", "output": "output",  # TensorBoard / W&B, Hub upload
}
YAML_ONLY = ("version", "distributed.")  # exact key, or a prefix ending in "."

# Friendlier names for the keys a newcomer meets first; the others are derived from the key's last part.
LABELS = {
    "model.family": "Model family", "model.path": "Base model", "data.path": "Training images folder",
    "data.instance_prompt": "Instance prompt", "method": "Method", "lora.rank": "LoRA rank",
    "lora.alpha": "LoRA alpha", "devices": "Devices", "batch.total": "Batch size (effective)",
    "batch.per_device": "Batch per device", "precision": "Precision", "seed": "Seed", "train.steps": "Steps",
    "train.lr": "Learning rate", "train.scheduler": "LR schedule", "sample.every": "Sample every N steps",
    "sample.prompts": "Sample prompts (one per line)", "name": "Run name", "checkpoint.every": "Checkpoint every N steps",
    "data.val_split": "Validation split (held-out share)", "data.val_path": "Validation images folder",
    "data.masks": "Loss masks (alpha or a folder)",
    "data.control_path": "Control images folder (edit pairs: the sources, same file names)",
    "data.datasets": "Several folders (YAML list; instead of the folder above)",
}
# Keys a newcomer rarely touches: the form tucks them into a closed "More ... settings" panel of their group.
ADVANCED = {
    "model.config", "model.prediction_type", "model.revision", "model.variant", "data.caption_extension",
    "data.center_crop", "data.cache_latents", "data.cache_text_embeddings", "lora.dropout", "lora.unet_targets",
    "lora.text_encoder_targets", "full.ema_decay", "attention", "train.text_encoder_lr", "train.weight_decay",
    "train.betas", "train.eps", "train.max_grad_norm", "train.noise_offset", "train.min_snr_gamma",
    "train.max_nonfinite_steps", "sample.seed", "sample.guidance_scale", "sample.size", "eval.every", "eval.best",
    "data.bucket_step", "data.bucket_max_aspect", "data.bucket_min_side", "data.bucket_max_side",
    "data.caption_dropout", "data.shuffle_tags", "data.keep_tokens", "train.loss", "train.huber_delta",
    "train.input_perturbation", "model.zero_terminal_snr",
    "lora.factor", "lora.ema_decay", "data.datasets",
}
DEVICE_CHOICES = ["auto", "cpu:1", "cpu:2"]
TRISTATE = {"default": None, "yes": True, "no": False}  # an Optional[bool]: unset means "the engine decides"


@dataclass(frozen=True)
class FieldSpec:
    key: str
    kind: str  # bool | tristate | choice | int | float | text | lines | floats | yaml
    label: str
    help: str
    choices: tuple[str, ...] | None
    default: Any
    group: str
    optional: bool

    @property
    def elem_id(self) -> str:
        return "field-" + self.key.replace(".", "-").replace("_", "-")

    @property
    def error_id(self) -> str:
        return "err-" + self.key.replace(".", "-").replace("_", "-")


def _leaf_types(cls=Config, prefix: str = "") -> dict[str, Any]:
    """{dotted key: resolved type annotation} (the schema uses `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not MISSING and is_dataclass(f.default_factory):
            out.update(_leaf_types(f.default_factory, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hints[f.name]
    return out


def _kind(tp: Any, choices) -> tuple[str, bool]:
    """(widget kind, whether None is allowed) of a type annotation."""
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) is typing.Union and type(None) in args
    if optional:
        rest = [a for a in args if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    if choices:
        return "choice", optional
    if tp is bool:
        return ("tristate" if optional else "bool"), optional
    if tp is int:
        return "int", optional
    if tp is float:
        return "float", optional
    if tp is str:
        return "text", optional
    if typing.get_origin(tp) is list:
        inner = (typing.get_args(tp) or (str,))[0]
        if is_dataclass(inner):  # data.datasets: a list of mappings, typed as YAML
            return "yaml", optional
        return ("floats" if inner in (float, int) else "lines"), optional
    return "yaml", optional  # Any, Union[int, str]: typed as YAML (`auto`, `2`, `[0, 1]`, `cpu:2`)


def _label(key: str) -> str:
    return LABELS.get(key) or key.rsplit(".", 1)[-1].replace("_", " ").capitalize()


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def is_yaml_only(key: str) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in YAML_ONLY)


def build_specs() -> list[FieldSpec]:
    """One FieldSpec per schema key, in schema order (YAML-only keys included, with group "yaml")."""

    types = _leaf_types()
    specs = []
    for key, f in iter_keys():
        choices = f.metadata.get("choices")
        if key == "model.family":
            choices = tuple(family_names())
        kind, optional = _kind(types[key], choices)
        section = key.split(".", 1)[0]
        group = "yaml" if is_yaml_only(key) else f.metadata.get("group") or SECTION_GROUP.get(section, "other")
        help_text = " ".join(help_of(f).replace("`", "").split())
        specs.append(FieldSpec(key, kind, _label(key), help_text, choices, _default(f), group, optional))
    return specs


SPECS = build_specs()
SPEC = {s.key: s for s in SPECS}
FORM_SPECS = [s for s in SPECS if s.group != "yaml"]
FORM_KEYS = [s.key for s in FORM_SPECS]


def grouped() -> dict[str, list[FieldSpec]]:
    """Form groups in page order, each with its fields (groups without fields left out)."""
    out: dict[str, list[FieldSpec]] = {g: [] for g in GROUPS}
    for spec in FORM_SPECS:
        out.setdefault(spec.group, []).append(spec)
    return {g: specs for g, specs in out.items() if specs}


# ----------------------------------------------------------------------------------------------------------------
# values <-> widget values


def to_widget(spec: FieldSpec, value: Any) -> Any:
    """What the widget of `spec` shows for `value`."""
    if spec.kind == "bool":
        return bool(value)
    if spec.kind == "int":
        # A number the browser's widget can hold exactly: a larger int broke Gradio's event stream ("Integer exceeds
        # 64-bit range") and inf/nan its JSON. The field then shows empty, its problem named beside it.
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return value if number and math.isfinite(value) and abs(value) <= 2**53 else None
    if spec.kind == "choice":
        return value
    if spec.kind == "tristate":
        return next((label for label, v in TRISTATE.items() if v is value), str(value))
    if value is None:
        return ""
    if spec.kind == "float":
        return repr(value) if isinstance(value, float) else str(value)
    if spec.kind == "lines":
        return "\n".join(map(str, value)) if isinstance(value, list) else str(value)
    if spec.kind == "floats":
        return ", ".join(repr(v) if isinstance(v, float) else str(v) for v in value) if isinstance(value, list) else str(value)
    if spec.kind == "yaml":
        if isinstance(value, str):
            return value
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return str(value)


def _number(text: str) -> Any:
    """int or float when `text` is one, else the text (the engine then names the key that is wrong)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def from_widget(spec: FieldSpec, raw: Any) -> Any:
    """The config value a widget's content means. Never raises: unparsable text stays text for the engine to report."""
    if spec.kind == "bool":
        return bool(raw)
    if spec.kind == "int":
        if raw is None or raw == "":
            return None
        return int(raw) if isinstance(raw, float) and raw.is_integer() else raw
    if spec.kind == "choice":
        return raw
    if spec.kind == "tristate":
        return TRISTATE.get(raw, raw)
    text = "" if raw is None else str(raw)
    if spec.kind == "lines":
        return [line.strip() for line in text.splitlines() if line.strip()]
    if not text.strip():
        if spec.kind == "yaml" and isinstance(spec.default, list):
            return []  # data.datasets emptied: none (data.path is used)
        return None if spec.optional or spec.kind in ("float", "yaml") else ""
    if spec.kind == "float":
        value = _number(text.strip())
        return float(value) if isinstance(value, int) else value
    if spec.kind == "floats":
        return [_number(part) for part in text.replace(",", " ").split()]
    if spec.kind == "yaml":
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text.strip()
    return text


def form_update(values: dict, widget_values: list, keys: list[str] = FORM_KEYS) -> dict:
    """`values` with the form's widgets (in `keys` order) applied."""
    out = dict(values)
    for key, raw in zip(keys, widget_values):
        out[key] = from_widget(SPEC[key], raw)
    return out


# ----------------------------------------------------------------------------------------------------------------
# values <-> nested dicts <-> YAML


def defaults() -> dict:
    return {s.key: s.default for s in SPECS}


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested preset dict -> {dotted key: value}, stopping at schema leaves (list values stay whole)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in SPEC:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def values_from_preset(raw: dict) -> dict:
    """A preset's sparse mapping laid over the schema defaults."""
    values = defaults()
    values.update(flatten(raw or {}))
    return values


def nested(values: dict, only: typing.Iterable[str] | None = None) -> dict:
    tree: dict = {}
    for key in (values if only is None else only):
        if key == YAML_ERROR:
            continue
        node = tree
        *head, last = key.split(".")
        for part in head:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):  # `lora: 3` and `lora.rank` typed together: keep the leaf visible
                child = node[part] = {}
            node = child
        node[last] = values[key]
    return tree


def sparse(values: dict) -> dict:
    """Only what differs from the defaults (how presets are written), plus `version`."""
    base = defaults()
    keys = ["version"] + [k for k in values if k != "version" and (k not in base or values[k] != base[k])]
    return nested(values, [k for k in keys if k in values])


def to_yaml(values: dict, full: bool = True) -> str:
    tree = nested(values) if full else sparse(values)
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=True, width=120)


class YamlError(ValueError):
    pass


# The YAML editor's text while it does not parse: its error is kept in the form's values under this key (never a
# config key), so the problems next to Start, Start itself and Save name the parse error, not whatever a half-typed
# earlier text parsed to. Any edit that makes the values whole again (a field, a preset, YAML that parses) drops it.
YAML_ERROR = "__yaml_error__"


def with_yaml_error(values: dict, error: str) -> dict:
    return {**values, YAML_ERROR: error}


def without_yaml_error(values: dict) -> dict:
    return {k: v for k, v in values.items() if k != YAML_ERROR}


def from_yaml(text: str) -> dict:
    """YAML text (full or sparse) -> values over the defaults. Raises YamlError with a message a user can act on."""
    if not text.strip():
        return defaults()
    try:
        raw = OmegaConf.to_container(OmegaConf.create(text), resolve=False)  # same parser as preset files
    except Exception as exc:  # yaml.YAMLError, OmegaConf's errors: say where the syntax broke
        raise YamlError(f"YAML: {' '.join(str(exc).split())[:300]}") from None
    if not isinstance(raw, dict):
        raise YamlError("YAML: the config must be a mapping of keys, like `train: {steps: 100}`")
    return values_from_preset(raw)
