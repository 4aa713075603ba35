"""Which optional extras of pyproject.toml a config needs: one table, read by the config checks (a missing package
is a problem naming the extra that installs it) and by the tests that hold the Docker image and CI to every
shipped preset (tests/test_docker.py, tests/test_shipped_presets.py). Torch-free.

Everything a shipped preset needs without a choice of the user's (torch, diffusers, transformers, scipy for the
DETR-family loss, ...) is a core dependency; an extra is only ever pulled in by a key's value, listed here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

from trainer.core.config.schema import Config


@dataclass(frozen=True)
class Extra:
    """One optional extra of pyproject.toml and the config values that need it."""

    name: str  # the extra: `pip install 'imagetune[<name>]'`
    module: str  # what the code imports from it
    needed_by: Callable[[Config], str | None]  # "key: value" when this config needs it, else None
    cuda_only: bool = False  # its kernels run on CUDA GPUs only (a CPU machine cannot train with it)


def _value_of(key: str, *values: str) -> Callable[[Config], str | None]:
    def needed(config: Config) -> str | None:
        value: object = config
        for part in key.split("."):
            value = getattr(value, part)
        return f"{key}: {value}" if value in values else None
    return needed


EXTRAS: tuple[Extra, ...] = (
    Extra("nf4", "torchao", _value_of("model.base_weights", "nf4", "int8")),
    Extra("nf4", "torchao", _value_of("model.text_encoder_weights", "nf4", "int8")),
    Extra("optimizers", "prodigyopt", _value_of("train.optimizer", "prodigy")),
    Extra("optimizers", "schedulefree", _value_of("train.optimizer", "adamw_schedulefree")),
    Extra("deepspeed", "deepspeed", _value_of("distributed.sharding", "deepspeed")),
    Extra("bnb", "bitsandbytes", _value_of("train.optimizer", "adamw8bit"), cuda_only=True),
    Extra("xformers", "xformers", _value_of("attention", "xformers"), cuda_only=True),
    Extra("tensorboard", "tensorboard", lambda c: "logging.tensorboard: true" if c.logging.tensorboard else None),
    Extra("wandb", "wandb", lambda c: f"logging.wandb: {c.logging.wandb}" if c.logging.wandb else None),
)


def extras_needed(config: Config) -> dict[str, str]:
    """{extra: the "key: value" that needs it} for this config."""
    out: dict[str, str] = {}
    for extra in EXTRAS:
        why = extra.needed_by(config)
        if why:
            out.setdefault(extra.name, why)
    return out


def missing_extra_problems(config: Config) -> list[str]:
    """A problem for each package this config needs that is not installed here. The CUDA-only ones are left to
    the plan, which knows whether this machine has a GPU for them."""
    return [f"{why} needs the `{extra.module}` package, which is not installed: "
            f"`pip install 'imagetune[{extra.name}]'`, or choose another value"
            for extra in EXTRAS if not extra.cuda_only
            and (why := extra.needed_by(config)) and importlib.util.find_spec(extra.module) is None]
