"""Config checks the diffusion families share (torch-free): the base model and the image folder exist."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.core.config.validate import DEMO_SCHEME, is_hub_id


def model_path_problem(key: str, path: str) -> str | None:
    if not path:
        return f"{key}: is empty; set it to a diffusers folder, a .safetensors file or a hub id"
    if path.startswith(DEMO_SCHEME) or Path(path).expanduser().exists():
        return None
    if is_hub_id(path):
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            return f"{key}: '{path}' looks like a hub id, but HF_HUB_OFFLINE=1; download it first or use a local path"
        return None
    return f"{key}: '{path}' does not exist; give a local folder/file that exists or a hub id like org/name"


def diffusion_checks(config, *, check_paths: bool = True) -> list[str]:
    """model.path / model.config name a model; data.path a folder of captioned images."""
    if not check_paths:
        return []
    p = [q for key, value in (("model.path", config.model.path), ("model.config", config.model.config))
         if (key == "model.path" or value) and (q := model_path_problem(key, value))]
    data = config.data.path
    if not data:
        p.append("data.path: is empty; set it to a folder of training images")
    elif not data.startswith(DEMO_SCHEME) and not Path(data).expanduser().is_dir():
        p.append(f"data.path: folder '{data}' does not exist; point it at a folder of images")
    return p
