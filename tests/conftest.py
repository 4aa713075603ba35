"""Shared fixtures: the tiny SD model and the demo dataset are built once per test session, offline."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the suite may reach the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One OpenMP thread per process, here and in every run the suite launches (the launcher passes it on): the suite
# runs on two pytest-xdist workers (pyproject's addopts), and on 2 cores two-thread processes side by side spend
# their time waiting for each other. Measured on 2 cores (test_demo_presets + test_presets_run + test_flux_sd3):
# serial 155 s with one thread or two; two workers 94 s with one thread, 286 s with two.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# a fault switch left in the shell would crash or stop every run the suite launches (tests set it per launch)
os.environ.pop("IMAGETUNE_FAULT", None)

import trainer.families  # noqa: E402,F401  (the entry point of every test: fills the family registry)


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    from trainer.families.sd.demo import ensure_demo_assets

    return ensure_demo_assets(tmp_path_factory.mktemp("demo-assets"))


@pytest.fixture(scope="session")
def tiny_sd_path(demo_assets):
    return demo_assets["tiny-sd"]


@pytest.fixture(scope="session")
def demo_data_path(demo_assets):
    return demo_assets["demo-data"]


# The tiny SDXL / FLUX / SD3 models, built once per session for every module that trains or exports with them
# (each build also pays the first import of its model classes). Tests only read them: a test that needs another
# variant (other widths, no guidance embedding) builds its own.


@pytest.fixture(scope="session")
def tiny_sdxl_path(tmp_path_factory):
    from trainer.families.sdxl.demo import make_tiny_sdxl

    return make_tiny_sdxl(tmp_path_factory.mktemp("tiny-sdxl") / "model")


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    from trainer.families.flow.demo import make_tiny_flux

    return make_tiny_flux(tmp_path_factory.mktemp("tiny-flux") / "model")


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    from trainer.families.flow.demo import make_tiny_sd3

    return make_tiny_sd3(tmp_path_factory.mktemp("tiny-sd3") / "model")


@pytest.fixture(scope="session")
def demo_asset(tmp_path_factory):
    """`demo_asset("tiny-zimage")`: the path of any family's registered demo asset (`demo://NAME` of a demo preset,
    trainer.families.demo_builders), built on first use into one session folder, so every module that asks for
    the same asset shares one build."""
    from trainer.families import demo_builders, load_object

    root = tmp_path_factory.mktemp("demo-builders")
    built: dict = {}

    def get(name):
        if name not in built:
            built.update(load_object(demo_builders()[name])(root))
        return built[name]

    return get
