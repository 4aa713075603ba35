"""Validate the form's values the way `launch.py` would, and say which field each problem belongs to.

The engine reports problems as `"dotted.key: message"` (trainer.core.config.load / trainer.core.plan); the key prefix puts
each message next to its field. Problems about keys without a field (YAML-only or unknown keys) are listed
with the plan. The plan line itself comes from `trainer.core.plan.make_plan` on this machine's hardware.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from app.forms import FORM_KEYS, SPEC, YAML_ERROR, nested
from app.security import Workspace
from trainer.core.config import Config, load_config
from trainer.errors import ConfigError, UserError
from trainer.core.hardware import Hardware
from trainer.core.model_size import trained_parameters
from trainer.core.plan import Plan, make_plan

# What the plan is made of: while one of these is wrong, no plan is shown.
PLAN_KEYS = {"devices", "precision", "attention", "batch.total", "batch.per_device", "train.steps",
             "train.optimizer", "distributed.nodes"}


@dataclass
class Check:
    config: Config | None = None
    plan: Plan | None = None
    field_errors: dict[str, list[str]] = field(default_factory=dict)
    other_errors: list[str] = field(default_factory=list)
    waiting_for_hardware: bool = False

    @property
    def ok(self) -> bool:
        """Valid and planned: a run can start (`config` is None while anything is wrong)."""
        return self.config is not None and self.plan is not None and not self.problem_count

    @property
    def problem_count(self) -> int:
        return sum(map(len, self.field_errors.values())) + len(self.other_errors)

    def add(self, problem: str) -> None:
        key, sep, message = problem.partition(":")
        key = key.strip()
        if sep and key in FORM_KEYS:
            self.field_errors.setdefault(key, []).append(message.strip())
        else:
            self.other_errors.append(problem)

    def error_text(self, key: str) -> str:
        return "\n".join(self.field_errors.get(key, []))


def _required(values: dict) -> list[str]:
    """Empty values of keys that need one (OmegaConf's own message for None is obscure)."""
    return [f"{key}: needs a value" for key, spec in SPEC.items()
            if values.get(key) is None and not spec.optional and spec.default is not None]


def check_values(values: dict, hardware: Callable[[Config], Hardware | None] | Hardware | None,
                 workspace: Workspace | None = None) -> Check:
    """Everything wrong with `values`, all at once; and the plan when there is nothing wrong.

    `hardware` is the machine's Hardware, or a function of the config giving it (None: not known yet, so the plan
    waits; a cpu:N plan never needs it).
    """
    result = Check()
    if values.get(YAML_ERROR):
        result.other_errors.append(f"{values[YAML_ERROR]}. Fix the YAML editor's text (the form follows it once "
                                   "it parses).")
        return result
    for problem in _required(values):
        result.add(problem)
    if result.problem_count:
        return result
    raw_problems = workspace.config_problems(values) if workspace is not None else []
    for problem in raw_problems:
        result.add(problem)
    config: Config | None
    try:
        config = load_config(nested(values), check_paths=True)
        result.config = config
        # What the run would really use: the built config's paths (and what its dataset descriptor names),
        # multi-node settings; the raw values' problems above are not repeated.
        for problem in workspace.built_problems(config) if workspace is not None else ():
            if problem not in raw_problems:
                result.add(problem)
    except ConfigError as exc:
        for problem in exc.problems:
            result.add(problem)
        config = _plannable(values, exc.problems)  # show the plan while the marked problems get fixed
    except UserError as exc:
        result.other_errors.append(str(exc))
        return result
    if config is None:
        return result
    hw = hardware(config) if callable(hardware) else hardware
    if hw is None:
        result.waiting_for_hardware = True
        return result
    try:
        result.plan = make_plan(config, hw, trained_parameters(config.model.family, config.model.path)
                                if config.method == "full" else None)
    except ConfigError as exc:
        for problem in exc.problems:
            result.add(problem)
    if result.problem_count:
        result.config = None
    return result


def _plannable(values: dict, problems: list[str]) -> Config | None:
    """A config for the plan despite `problems`: their keys at the defaults (unless the plan needs them), paths
    unchecked. None when the problems are in what the plan is made of."""
    bad = {p.split(":", 1)[0].strip() for p in problems}
    if bad & PLAN_KEYS:
        return None
    fixed = {k: (SPEC[k].default if k in bad and k in SPEC else v) for k, v in values.items() if k in SPEC}
    try:
        return load_config(nested(fixed), check_paths=False)
    except UserError:
        return None
