"""Model families behind one small protocol (see base.py). The registry maps a name to `module:Class` so that
listing families (for validation and the UI) imports no torch; a family's module is imported only to train."""

from __future__ import annotations

import importlib

FAMILIES: dict[str, str] = {
    "sd": "trainer.families.sd:StableDiffusionFamily",
}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def get_family(name: str):
    """The family class registered under `name` (imports its module, and so torch)."""
    module_name, class_name = FAMILIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
