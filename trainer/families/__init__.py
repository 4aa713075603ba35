"""Model families behind one small protocol (see base.py). The registry maps a name to `module:Class` so that
listing families (for validation and the UI) imports no torch; a family's module is imported only to train."""

from __future__ import annotations

import importlib

FAMILIES: dict[str, str] = {
    "sd": "trainer.families.sd.family:StableDiffusionFamily",
    "sdxl": "trainer.families.sdxl.family:StableDiffusionXLFamily",
    "sd3": "trainer.families.flow.sd3:SD3Family",
    "flux": "trainer.families.flow.flux:FluxFamily",
    "detection": "trainer.families.detection.family:DetectionFamily",
}

# The launcher's data check of each family, run before any process starts: torch-free, raises UserError when
# the dataset cannot train at all. Families not listed take the captioned-images check.
DATA_CHECKS: dict[str, str] = {
    "detection": "trainer.families.detection.data:check_detection_data",
}


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def check_captioned_images(config) -> None:
    """The diffusion families' check: a folder of images with captions (trainer.core.data.scan). Returns the scan
    (the launcher lists its aspect-ratio buckets in the plan)."""
    from trainer.core.data.scan import require_usable, scan_dataset

    data = config.data
    scan = scan_dataset(data.path, instance_prompt=data.instance_prompt, caption_extension=data.caption_extension,
                        resolution=data.resolution)
    require_usable(scan)
    return scan


def data_check(name: str):
    """The torch-free data check of family `name`: a callable(config) raising UserError (it may return the
    dataset scan, for the plan's bucket list)."""
    if name not in DATA_CHECKS:
        return check_captioned_images
    module_name, function_name = DATA_CHECKS[name].split(":")
    return getattr(importlib.import_module(module_name), function_name)


def get_family(name: str):
    """The family class registered under `name` (imports its module, and so torch)."""
    module_name, class_name = FAMILIES[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
