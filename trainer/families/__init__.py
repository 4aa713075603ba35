"""The model families: one folder each, registered here by their torch-free spec (trainer.core.family_spec).

Adding a family is its folder (spec.py, the Family implementation, a demo builder), presets, tests, and one
line below. Nothing here imports torch: the web UI and the launcher read the specs; the worker imports a
family's implementation through `get_family`. The registry itself is core's (trainer.core.registry): importing
this package fills it, so every entry point imports it once; the names below are re-exported for the families,
the engine and the UI.
"""

from __future__ import annotations

from trainer.core.family_spec import load_object
from trainer.core.registry import SPECS, demo_builders, family_names, register, spec_of

# The registry, one line a family; registered in the UI's order below.
from trainer.families.chroma.spec import CHROMA
from trainer.families.detection.spec import SPEC as DETECTION
from trainer.families.flow.spec import FLUX, SD3
from trainer.families.flux2.spec import FLUX2, FLUX2_KLEIN
from trainer.families.flux_kontext.spec import FLUX_KONTEXT
from trainer.families.qwenimage.spec import QWENIMAGE
from trainer.families.qwenimage_edit.spec import QWENIMAGE_EDIT
from trainer.families.sd.spec import SPEC as SD
from trainer.families.sdxl.spec import SPEC as SDXL
from trainer.families.zimage.spec import ZIMAGE

for _spec in (SD, SDXL, SD3, FLUX, FLUX2, FLUX2_KLEIN, CHROMA, ZIMAGE, QWENIMAGE, FLUX_KONTEXT, QWENIMAGE_EDIT,
              DETECTION):
    register(_spec)

__all__ = ["SPECS", "demo_builders", "family_names", "get_family", "spec_of"]


def get_family(name: str):
    """The Family class of `name` (imports its module, and so torch)."""
    return load_object(SPECS[name].implementation)
