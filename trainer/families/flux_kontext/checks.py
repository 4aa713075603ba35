"""FLUX.1 Kontext's config checks, torch-free: the flow-matching ones, and its paired data (data.control_path)."""

from __future__ import annotations

from pathlib import Path

from trainer.core.config.validate import DEMO_SCHEME
from trainer.families.flow.checks import flow_checks


def control_path_problems(config, family: str, *, check_paths: bool = True) -> list[str]:
    """An edit family trains pairs: data.control_path must name a folder of control images."""
    folder = config.data.control_path
    if not folder:
        return [f"data.control_path: {family} trains instruction edits, each training image (the edit's result) "
                "with its control image (the source it was made from): set data.control_path to the folder of "
                "control images, named like the training images (ai-toolkit's control_path)"]
    if check_paths and not folder.startswith(DEMO_SCHEME) and not Path(folder).expanduser().is_dir():
        return [f"data.control_path: folder '{folder}' does not exist; point it at the folder of control images "
                "named like the training images"]
    return []


def flux_kontext_checks(config, *, check_paths: bool = True) -> list[str]:
    return flow_checks(config, check_paths=check_paths) + control_path_problems(config, "flux_kontext",
                                                                               check_paths=check_paths)
