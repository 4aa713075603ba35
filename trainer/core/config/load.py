"""Load a preset: YAML + `KEY=VALUE` overrides -> migrated -> typed `Config`, with every problem reported at once.

OmegaConf does the YAML, the dotted overrides and the type conversion; this module walks the user's keys one
by one so that one bad key does not hide the next, and suggests the closest valid name for a mistyped key.

`model.family` is checked against the family registry (trainer.core.registry), which this module does not fill:
the process's entry point has imported `trainer.families` (core never does); read empty, it raises naming that
import.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.core.config.bounds import number_problem
from trainer.core.config.schema import SCHEMA_VERSION, Config, iter_keys
from trainer.core.config.validate import validate
from trainer.core.registry import family_names
from trainer.errors import ConfigError, UserError

# version -> function turning a preset dict of that version into the next version. Each migration is small,
# pure and tested; `load_config` applies them in order so a v1 preset still loads when the schema is at v5.
MIGRATIONS: dict[int, Callable[[dict], dict]] = {}

# Keys whose value is a whole mapping or list rather than a leaf (so their contents are not walked).
_LEAF_KEYS = {name for name, _ in iter_keys()}


_ENTRY_LISTS = {"data.datasets"}
# Keys whose choices are `on` / `off`: YAML 1.1 (presets, KEY=VALUE) reads those words as booleans.
_ON_OFF_KEYS = {name for name, f in iter_keys() if {"on", "off"} <= set(f.metadata.get("choices") or ())}

INTERPOLATION = "${"


def interpolation_problems(tree: Any, prefix: str = "") -> list[str]:
    """`key: ...` for every key or string value holding `${`. OmegaConf would resolve it when the config is built
    (`${oc.env:TOKEN}` reads the environment, `${other.key}` copies another value), so a value typed into the UI
    could leak a secret into the run name or move a path outside the workspace: values are data, never code."""
    problems = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            key = f"{prefix}{k}"
            if INTERPOLATION in str(k):
                problems.append(f"{key}: a key may not contain '${{'")
            else:
                problems += interpolation_problems(v, key + ".")
    elif isinstance(tree, (list, tuple)):
        for v in tree:  # a list item is reported under its list's key, where the UI marks it
            problems += interpolation_problems(v, prefix)
    elif isinstance(tree, str) and INTERPOLATION in tree:
        problems.append(f"{prefix.rstrip('.')}: {tree!r} contains '${{', which this trainer does not expand "
                        "(no ${...} interpolation); type the value itself")
    return problems


def refuse_interpolation(tree: Any, source: str) -> None:
    problems = interpolation_problems(tree)
    if problems:
        raise ConfigError(problems, source)


def read_preset(path: str | Path) -> dict:
    """The raw (unvalidated) mapping of a preset file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"Preset file '{path}' does not exist. Pass the path of a YAML preset, e.g. presets/demo.yaml "
            "(`ls presets/` lists the shipped ones)."
        )
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and friends: show where the syntax broke
        raise UserError(f"Preset file '{path}' is not valid YAML: {exc}. Fix the line it names.") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"Preset file '{path}' must hold a mapping of keys (like `train: {{steps: 100}}`).")
    return OmegaConf.to_container(raw, resolve=False)  # type: ignore[return-value]


def parse_overrides(overrides: Iterable[str]) -> dict:
    """`["train.lr=1e-4", "sample.prompts=[a,b]"]` -> nested dict (values parsed as YAML)."""
    overrides = list(overrides)
    bad = [o for o in overrides if "=" not in o or not o.split("=", 1)[0].strip()]
    if bad:
        raise UserError(
            f"Overrides must look like KEY=VALUE (for example train.lr=1e-4); got {', '.join(map(repr, bad))}."
        )
    refuse_interpolation({o.split("=", 1)[0].strip(): o.split("=", 1)[1] for o in overrides}, "the overrides")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(overrides), resolve=False)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise UserError(f"Could not parse the overrides {overrides}: {exc}") from None


def migrate(raw: dict, source: str = "the preset") -> dict:
    """Bring a preset dict up to SCHEMA_VERSION. A preset without `version` is taken as current."""
    version = raw.get("version", SCHEMA_VERSION)
    if not isinstance(version, int) or version < 1:
        raise ConfigError([f"version: must be a positive integer, got {version!r}"], source)
    if version > SCHEMA_VERSION:
        raise ConfigError(
            [f"version: {version} is newer than this trainer understands ({SCHEMA_VERSION}); update the trainer"],
            source,
        )
    while version < SCHEMA_VERSION:
        raw = MIGRATIONS[version](dict(raw))
        version += 1
        raw["version"] = version
    return raw


def _leaves(tree: Any, prefix: str = ""):
    """(dotted key, value) pairs of a nested dict, stopping at schema leaves (lists stay whole)."""
    if isinstance(tree, dict) and prefix.rstrip(".") not in _LEAF_KEYS:
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), tree


# Names other trainers (diffusers examples, kohya sd-scripts) use for our keys, so their users find ours.
KNOWN_ALIASES = {
    "learning_rate": "train.lr",
    "max_train_steps": "train.steps",
    "train_batch_size": "batch.per_device",
    "gradient_accumulation_steps": "batch.total (the effective batch; accumulation is derived from it)",
    "mixed_precision": "precision",
    "pretrained_model_name_or_path": "model.path",
    "instance_data_dir": "data.path",
    "train_data_dir": "data.path",
    "lr_scheduler": "train.scheduler",
    "lr_warmup_steps": "train.warmup_steps",
    "network_dim": "lora.rank",
    "network_alpha": "lora.alpha",
    "save_every_n_steps": "checkpoint.every",
}


def _suggest(name: str) -> str:
    alias = KNOWN_ALIASES.get(name.rsplit(".", 1)[-1])
    if alias:
        return f" (did you mean '{alias}'?)"
    close = difflib.get_close_matches(name, sorted(_LEAF_KEYS), n=1, cutoff=0.6)
    if not close:  # a bare leaf name in the wrong section, e.g. `lr` instead of `train.lr`
        tail = name.rsplit(".", 1)[-1]
        close = [k for k in sorted(_LEAF_KEYS) if k.rsplit(".", 1)[-1] == tail][:1]
    return f" (did you mean '{close[0]}'?)" if close else ""


# Values renamed since a preset or a run folder's config.yaml may have been written with them: read as the new
# name (a run started before the rename still resumes; the choices and the UI show the new one only).
RENAMED_VALUES = {
    "model.base_weights": {"default": "bf16"},  # "unquantized": the peers' and the issue's name for it
}


def build_config(raw: dict) -> tuple[Config, list[str]]:
    """Typed Config from a (migrated) raw dict, and the keys that could not be applied (left at defaults)."""
    base = OmegaConf.structured(Config)
    problems: list[str] = []
    for name, value in _leaves(raw):
        if name not in _LEAF_KEYS:
            problems.append(f"{name}: unknown key{_suggest(name)}")
            continue
        if name in _ON_OFF_KEYS and isinstance(value, bool):
            value = "on" if value else "off"
        if isinstance(value, str):
            value = RENAMED_VALUES.get(name, {}).get(value, value)
        if (too_big := number_problem(name, value)):
            problems.append(too_big)  # before OmegaConf, whose message for inf names no fix
            continue
        try:
            # A list of mappings (data.datasets) is merged into its typed entries, which checks each entry's keys.
            OmegaConf.update(base, name, value, merge=name in _ENTRY_LISTS)
        except OmegaConfBaseException as exc:
            msg = str(exc).splitlines()[0]
            problems.append(f"{name}: {msg}")
    for name, f in iter_keys():
        choices = f.metadata.get("choices")
        if name == "model.family":
            choices = family_names()
        if choices:
            value = OmegaConf.select(base, name)
            if value not in choices:
                problems.append(f"{name}: {value!r} is not one of {', '.join(choices)}{_closest(value, choices)}")
    config: Config = OmegaConf.to_object(base)  # type: ignore[assignment]
    return config, problems


def _closest(value: Any, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def load_config(
    preset: str | Path | dict | None = None, overrides: Iterable[str] = (), *, check_paths: bool = True
) -> Config:
    """Preset file (or dict) + overrides -> validated Config. Raises ConfigError/UserError with all problems."""
    if preset is None:
        raw, source = {}, "the defaults"
    elif isinstance(preset, dict):
        raw, source = dict(preset), "the preset"
    else:
        raw, source = read_preset(preset), f"preset '{preset}'"
    refuse_interpolation(raw, source)
    override_tree = parse_overrides(overrides)
    merged = OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(raw), OmegaConf.create(override_tree)),
                                    resolve=False)
    merged = migrate(merged, source)  # type: ignore[arg-type]
    config, problems = build_config(merged)
    # Semantic checks run even when some keys were rejected, so the user sees everything in one go; a key
    # that was rejected is left at its default and not reported twice.
    rejected = {problem.split(":", 1)[0] for problem in problems}
    problems += [q for q in validate(config, check_paths=check_paths) if q.split(":", 1)[0] not in rejected]
    if problems:
        raise ConfigError(*blame_overrides(problems, overrides, source))
    return config


def blame_overrides(problems: list[str], overrides: Iterable[str], source: str) -> tuple[list[str], str]:
    """The problems with each one a KEY=VALUE override caused naming that override, and a source that names the
    command line: a bad `train.lr=-1` is not the preset file's fault, and the user must not go looking in it."""
    given = {o.split("=", 1)[0].strip(): o.strip() for o in overrides}

    def culprit(problem: str) -> str | None:
        key = problem.split(":", 1)[0].strip()
        return next((o for k, o in given.items() if key == k or key.startswith(k + ".") or k.startswith(key + ".")),
                    None)

    blamed = [(p, culprit(p)) for p in problems]
    tagged = [f"{p} (set on the command line: {o})" if o else p for p, o in blamed]
    ours = sum(o is not None for _, o in blamed)
    if not ours:
        return tagged, source
    return tagged, ("the command line" if ours == len(problems) else f"{source}, with the command line's overrides,")


def to_yaml(config: Config) -> str:
    """The fully resolved config as YAML (what a run folder's config.yaml holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def to_dict(config: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(config))  # type: ignore[return-value]


