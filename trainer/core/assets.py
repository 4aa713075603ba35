"""Paths in a config, made to mean the same from anywhere: `demo://NAME` built (once) and resolved, local paths
made absolute, so that a run folder's config.yaml means the same thing from another working directory or on
resume. Torch-free: demo assets are built in a child process."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

from trainer.core.config import Config
from trainer.core.config.validate import DEMO_SCHEME, hub_id_at
from trainer.errors import UserError
from trainer.core.registry import demo_builders, spec_of

DEMO_DIR = ".demo"  # under the runs folder: the demo models and data are built there once and shared by runs

_BUILD_DEMO = """import importlib, json, sys
found = {}
for spec in sys.argv[2:]:
    module, function = spec.split(":")
    found.update(getattr(importlib.import_module(module), function)(sys.argv[1]))
print(json.dumps({k: str(v) for k, v in found.items()}))"""


def demo_assets(root: Path, names=None) -> dict[str, Path]:
    """Build (once) and locate the offline demo assets `names` (default: all), as registered by the families'
    specs. Building may need torch and diffusers, so it runs in a child process: the launcher, and the web UI
    that calls it, stay free of torch."""
    registry = demo_builders()
    wanted = registry if names is None else [n for n in names if n in registry]
    builders = sorted({registry[n] for n in wanted})
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", _BUILD_DEMO, str(root), *builders], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"Could not build the offline demo assets in {root}: {last}")
    return {name: Path(path) for name, path in json.loads(result.stdout.strip().splitlines()[-1]).items()}


SHIPPED_DIR = Path(__file__).resolve().parents[1] / "assets"  # trainer/assets: demo assets in the package


def demo_asset_name(path: str | os.PathLike, runs_dir: str | Path | None = None) -> str | None:
    """The `demo://NAME` that `path` is once resolved (the shipped copy in the package, or the one built under the
    runs folder's .demo/), else None. A resumed demo run's config.yaml holds the resolved path, which lies in the
    package, outside any workspace; an exposed UI trusts it by this name, not by where it lies."""
    real = os.path.realpath(path)
    homes = [SHIPPED_DIR, *([Path(runs_dir).expanduser() / DEMO_DIR] if runs_dir is not None else [])]
    for name in demo_builders():
        if any(real == os.path.realpath(home / name) for home in homes if (home / name).exists()):
            return name
    return None


def resolve_paths(config: Config, runs_dir: str | Path) -> Config:
    """A copy of `config` with `demo://NAME` built and resolved, and local paths made absolute, so that the
    run folder's config.yaml still means the same thing from another working directory (or on resume)."""
    config = copy.deepcopy(config)
    spec = spec_of(config.model.family)
    demo_keys = [k for k in ("model.path", *spec.path_keys) if _get(config, k).startswith(DEMO_SCHEME)]
    demo_keys = list(dict.fromkeys(demo_keys))
    if demo_keys:
        names = [_get(config, key)[len(DEMO_SCHEME):] for key in demo_keys]
        registry = demo_builders()
        for key, name in zip(demo_keys, names):
            if name not in registry:
                known = ", ".join(f"demo://{a}" for a in registry)
                raise UserError(f"{key}: unknown demo asset '{name}'; the demo has {known}.")
        assets = demo_assets(Path(runs_dir).expanduser().resolve() / DEMO_DIR, names)
        for key, name in zip(demo_keys, names):
            _set(config, key, str(assets[name]))
    for key in spec.path_keys:
        value = _get(config, key)
        if spec.is_path(key, value) and not value.startswith(DEMO_SCHEME) and not hub_id_at(key, value):
            _set(config, key, str(Path(value).expanduser().resolve()))
    for i, entry in enumerate(config.data.datasets):  # data.datasets: each entry's folder, like data.path
        if entry.path.startswith(DEMO_SCHEME):
            name = entry.path[len(DEMO_SCHEME):]
            if name not in demo_builders():
                raise UserError(f"data.datasets[{i}].path: unknown demo asset '{name}'; the demo has "
                                + ", ".join(f"demo://{a}" for a in demo_builders()) + ".")
            entry.path = str(demo_assets(Path(runs_dir).expanduser().resolve() / DEMO_DIR, [name])[name])
        elif entry.path:
            entry.path = str(Path(entry.path).expanduser().resolve())
    return config


def _get(config: Config, key: str):
    obj = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj if obj is not None else ""


def _set(config: Config, key: str, value) -> None:
    *head, last = key.split(".")
    obj = config
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)
