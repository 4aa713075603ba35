"""`lora.init_from`: start a LoRA from an existing LoRA file instead of zero.

The file is read by diffusers' own loader (`pipe.load_lora_weights`), as a second adapter on the untouched
models, which is what knows every layout a user may bring: kohya `lora_unet_`/`lora_te_` names, FLUX's fused
BFL names (split back into q, k, v), diffusers and peft keys, alphas in `.alpha` tensors or in the file's
metadata. Each loaded layer's down, up, scaling (and DoRA magnitude) is kept, the adapter is unloaded (the base
weights are never touched), and once the run's own adapter exists each of its layers starts at that update:
up is multiplied by the file's scaling over the run's, so alpha / rank may differ from the file's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.core.config.lora_checks import init_file
from trainer.errors import UserError
from trainer.families.components.adapters import ADAPTER, adapter_layers, base_weight, kind, lora_product, row_norm

_LOADING = "init_from"


@dataclass
class LayerStart:
    down: torch.Tensor
    up: torch.Tensor
    scaling: float
    magnitude: torch.Tensor | None  # a DoRA file's


def read_start(pipe: Any, value: str, components: tuple[str, ...]) -> dict[str, dict[str, LayerStart]]:
    """{component: {module path: LayerStart}} of the LoRA file `value` (lora.init_from), loaded into `pipe`'s
    `components` (their attribute names) and unloaded again."""
    from peft.tuners.lora import LoraLayer
    from safetensors import safe_open

    file = init_file(value)
    with safe_open(str(file), framework="pt") as f:
        if any(k.endswith(".dora_scale") for k in f.keys()):
            raise UserError(f"lora.init_from: '{file}' is a kohya-format DoRA, whose magnitudes diffusers' loader "
                            "drops; start from the run's diffusers file (pytorch_lora_weights.safetensors) instead")
    try:
        pipe.load_lora_weights(str(file), adapter_name=_LOADING)
    except (ValueError, KeyError, RuntimeError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"lora.init_from: '{file}' is not a LoRA of this model that diffusers can read ({first}); "
                        "give a kohya or diffusers LoRA file trained on the same base model") from None
    start: dict[str, dict[str, LayerStart]] = {}
    try:
        for component in components:
            model = getattr(pipe, component, None)
            for path, layer in ([] if model is None else model.named_modules()):
                if isinstance(layer, LoraLayer) and _LOADING in layer.lora_A:
                    dora = layer.use_dora.get(_LOADING)
                    start.setdefault(component, {})[path] = LayerStart(
                        _copy(layer.lora_A[_LOADING]), _copy(layer.lora_B[_LOADING]), float(layer.scaling[_LOADING]),
                        _copy(layer.lora_magnitude_vector[_LOADING]) if dora else None)
    finally:
        pipe.unload_lora_weights()
    if not start:
        raise UserError(f"lora.init_from: diffusers found no LoRA layer of this model in '{file}'; is it a LoRA of "
                        "another model family?")
    return start


def _copy(module: Any) -> torch.Tensor:
    return module.weight.detach().float().clone()


@torch.no_grad()
def apply_start(start: dict[str, dict[str, LayerStart]], models: dict[str, torch.nn.Module], lora) -> None:
    """Give the run's adapter layers in `models` ({component: model}) the update `start` holds; every problem at
    once as a UserError naming what to change."""
    problems, planned = [], []
    dora_named = False
    for component, layers in start.items():
        ours = adapter_layers(models[component]) if component in models else {}
        if not ours:
            hint = "lora.train_text_encoder=true" if component.startswith("text_encoder") else "its targets"
            problems.append(f"the file adapts the {component}, which this run does not (set {hint})")
            continue
        missing = [path for path in layers if path not in ours]
        if missing:
            problems.append(f"it adapts {len(missing)} {component} layers this run does not, e.g. {missing[0]} "
                            "(add them to the targets: lora.unet_targets, lora.text_encoder_targets, "
                            "flow.lora_targets)")
        for path, layer_start in layers.items():
            if path in ours:
                rank = layer_start.down.shape[0]
                if rank != ours[path].r[ADAPTER]:
                    problems.append(f"{component}.{path} has rank {rank} in the file and {ours[path].r[ADAPTER]} "
                                    f"here (set lora.rank={rank})")
                if layer_start.magnitude is not None and kind(ours[path]) != "dora" and not dora_named:
                    dora_named = True
                    problems.append("the file is a DoRA (it has magnitudes): set lora.dora=true to start from it")
                planned.append((ours[path], layer_start))
    if problems:
        raise UserError(f"lora.init_from '{lora.init_from}' cannot start this run: " + "; ".join(problems) + ".")
    for layer, layer_start in planned:
        _start(layer, layer_start)


def _start(layer, start: LayerStart) -> None:
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    a.copy_(start.down.reshape(a.shape))
    b.copy_((start.up * (start.scaling / layer.scaling[ADAPTER])).reshape(b.shape))
    if kind(layer) != "dora":
        return
    # Without the file's magnitudes, the ones that make DoRA's weight W + scaling * up @ down, the file's update.
    m = start.magnitude if start.magnitude is not None else row_norm(base_weight(layer) + lora_product(layer))
    target = layer.lora_magnitude_vector[ADAPTER].weight
    target.copy_(m.reshape(target.shape))
