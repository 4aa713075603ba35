"""How big the trained network is, before anything is loaded: torch-free, for the plan (FSDP or not).

A local model is measured exactly from its safetensors headers (shapes only; no weight is read). A hub id or a
format we cannot read falls back to the published size of the family's base models (its spec).
"""

from __future__ import annotations

import json
import struct
from math import prod
from pathlib import Path

from trainer.core.registry import spec_of

# Bytes per trained parameter: fp32 weight + fp32 gradient + optimizer state.
OPTIMIZER_STATE_BYTES = {
    "adamw": 8, "adamw8bit": 2, "sgd": 4,
    "prodigy": 16,  # two moments, the running sum s and the initial weights p0
    "adafactor": 1,  # a row and a column second moment per matrix, no first moment: ~0 for weights
    "adamw_schedulefree": 8,  # z and the second moment
}


def safetensors_parameters(path: Path, prefix: str = "") -> int:
    """Number of elements in a .safetensors file (only tensors whose name starts with `prefix`)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return sum(prod(v["shape"]) for k, v in header.items() if k != "__metadata__" and k.startswith(prefix))


def trained_parameters(family: str, model_path: str) -> int | None:
    """Parameters of the network a full fine-tune of `family` trains (None when unknown): measured in the
    component folder its spec names, else the spec's published size."""
    spec = spec_of(family)
    component = spec.trained_component
    if component is None:
        return None
    local = Path(model_path).expanduser()
    try:
        if local.is_dir():
            files = sorted((local / component).glob("*.safetensors"))
            if files:
                return sum(safetensors_parameters(f) for f in files)
        elif local.is_file() and local.suffix == ".safetensors":
            # A single-file checkpoint (LDM / ComfyUI layout): the diffusion network's tensors.
            return safetensors_parameters(local, "model.diffusion_model.") or safetensors_parameters(local)
    except (OSError, ValueError, KeyError, struct.error):
        pass  # unreadable: fall back to the published size
    for variant, size in spec.published_variants.items():
        if variant in model_path.lower():
            return int(size)
    return int(spec.published_parameters) if spec.published_parameters else None


def full_finetune_bytes(parameters: int, optimizer: str) -> int:
    """Memory for weights, gradients and optimizer state of a full fine-tune (activations not included)."""
    return parameters * (4 + 4 + OPTIMIZER_STATE_BYTES.get(optimizer, 8))
