"""FLUX.1 Kontext's config checks, torch-free: the flow-matching ones, and its paired data (data.control_path)."""

from __future__ import annotations

from trainer.families.components.dataset_checks import control_path_problems
from trainer.families.flow.checks import flow_checks


def flux_kontext_checks(config, *, check_paths: bool = True) -> list[str]:
    return flow_checks(config, check_paths=check_paths) + control_path_problems(config, "flux_kontext",
                                                                               check_paths=check_paths)
