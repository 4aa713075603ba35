"""The model families: one folder each, registered here by their torch-free spec (trainer.families.spec).

Adding a family is its folder (spec.py, the Family implementation, a demo builder), presets, tests, and one
line below. Nothing here imports torch: the web UI and the launcher read the specs; the worker imports a
family's implementation through `get_family`.
"""

from __future__ import annotations

from trainer.families.spec import FamilySpec, load_object

from trainer.families.chroma.spec import CHROMA  # noqa: E402  (the registry, one line a family)
from trainer.families.detection.spec import SPEC as DETECTION  # noqa: E402
from trainer.families.flow.spec import FLUX, SD3  # noqa: E402
from trainer.families.flux2.spec import FLUX2, FLUX2_KLEIN  # noqa: E402
from trainer.families.flux_kontext.spec import FLUX_KONTEXT  # noqa: E402
from trainer.families.qwenimage.spec import QWENIMAGE  # noqa: E402
from trainer.families.sd.spec import SPEC as SD  # noqa: E402
from trainer.families.sdxl.spec import SPEC as SDXL  # noqa: E402
from trainer.families.zimage.spec import ZIMAGE  # noqa: E402

SPECS: dict[str, FamilySpec] = {spec.name: spec for spec in (SD, SDXL, SD3, FLUX, FLUX2, FLUX2_KLEIN, CHROMA, ZIMAGE,
                                                                QWENIMAGE, FLUX_KONTEXT, DETECTION)}


def family_names() -> tuple[str, ...]:
    return tuple(SPECS)


def spec_of(name: str) -> FamilySpec:
    """The spec of family `name` (validation has already refused unknown names; this raises KeyError)."""
    return SPECS[name]


def get_family(name: str):
    """The Family class of `name` (imports its module, and so torch)."""
    return load_object(SPECS[name].implementation)


def demo_builders() -> dict[str, str]:
    """`demo://NAME` -> "module:function" over every family's demo assets."""
    return {asset: ref for spec in SPECS.values() for asset, ref in spec.demo_assets.items()}
