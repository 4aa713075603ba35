"""The families are composed of shared components, not built on each other: no registered family class inherits
another family's class (the architecture's rule), so changing one family never changes another through a base
class. Shared parts live in trainer/families/components/ (and a family's own folder) and are held, not inherited."""

import pytest

from trainer.families import SPECS, get_family


@pytest.fixture(scope="module")
def implementations() -> dict[str, type]:
    return {name: get_family(name) for name in SPECS}


def test_no_family_class_inherits_another_family_class(implementations):
    for name, cls in implementations.items():
        others = {other: impl for other, impl in implementations.items() if impl is not cls}
        inherited = [other for other, impl in others.items() if impl in cls.__mro__]
        assert not inherited, f"{name} ({cls.__qualname__}) inherits the {inherited} family's class"

