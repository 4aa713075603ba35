"""The family registry: core owns the lookup, the families fill it (as timm's model registry is filled by its model
modules), so nothing in trainer/core imports trainer/families.

`trainer/families/__init__.py` is the one place listing every family: importing `trainer.families` registers
them all. Every process that reads the registry imports it once, at its entry point (launch.py, the web UI,
trainer.engine.worker / export, the bench scripts, tests/conftest.py); core's modules, `load_config` included,
only read it when called, never at import time. Read empty, it raises naming that import: an entry point that
forgot it fails at once, never with an empty list of families.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from trainer.core.family_spec import FamilySpec

EMPTY = ("the family registry is empty: no family has registered yet. Add `import trainer.families` to this "
         "process's entry point (it registers every family; trainer/core never imports it)")


class _Registry(Mapping[str, FamilySpec]):
    """A read-only view of the registered specs, in registration order."""

    def __init__(self) -> None:
        self._specs: dict[str, FamilySpec] = {}

    def _filled(self) -> dict[str, FamilySpec]:
        if not self._specs:
            raise RuntimeError(EMPTY)
        return self._specs

    def __getitem__(self, name: str) -> FamilySpec:
        return self._filled()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._filled())

    def __len__(self) -> int:
        return len(self._filled())


_REGISTRY = _Registry()
SPECS: Mapping[str, FamilySpec] = _REGISTRY


def register(spec: FamilySpec) -> FamilySpec:
    """Add `spec` under its name (a second spec of the same name is a mistake in the registry's list)."""
    specs = _REGISTRY._specs
    if spec.name in specs and specs[spec.name] is not spec:
        raise ValueError(f"two families are named {spec.name!r}: rename one of them (model.family must pick one)")
    specs[spec.name] = spec
    return spec


def family_names() -> tuple[str, ...]:
    return tuple(SPECS)


def spec_of(name: str) -> FamilySpec:
    """The spec of family `name` (validation has already refused unknown names; this raises KeyError)."""
    return SPECS[name]


def demo_builders() -> dict[str, str]:
    """`demo://NAME` -> "module:function" over every family's demo assets."""
    return {asset: ref for spec in SPECS.values() for asset, ref in spec.demo_assets.items()}
