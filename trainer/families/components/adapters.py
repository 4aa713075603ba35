"""The adapter a LoRA run trains (`lora.type`: LoRA, LoKr or LoHa, `lora.dora`), built with peft for every
diffusion family, and what each adapted layer adds to its weight.

peft rather than the `lycoris-lora` package: peft is already how every family adapts its models (diffusers'
`add_adapter`, checkpoints by parameter name, `pipe.load_lora_weights` for the diffusers file), its LoKr and
LoHa are LyCORIS' algorithms with LyCORIS' tensor layout (`lokr_w1`, `lokr_w2_a`, `hada_w1_a`... the very names
of the kohya files ComfyUI, Forge and A1111 load, see `lycoris_files`), and it is installed; lycoris-lora would
be a second adapter stack with its own module wrapping, naming and save path for the same maths.

One difference is LyCORIS' on purpose: peft scales every LoKr by alpha / rank, LyCORIS (and so every kohya-file
reader) only a LoKr with a low-rank factor. `add_adapter` gives LoKr layers whose factors are both full an alpha
equal to their rank (scale 1), recorded in the config's `alpha_pattern`, so training, the peft folder and the
kohya file agree.
"""

from __future__ import annotations

import re
from typing import Any

import torch

ADAPTER = "default"  # peft's adapter name, the one diffusers' add_adapter uses


def peft_config(lora, targets, **extra) -> Any:
    """The peft config of the `lora` section (LoraConfig / LoKrConfig / LoHaConfig) for `targets`."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    alpha: Any = lora.alpha  # peft annotates alpha as int; a float alpha only scales, as intended
    if lora.type == "lokr":
        return LoKrConfig(r=lora.rank, alpha=alpha, decompose_factor=lora.factor, target_modules=list(targets),
                          **extra)
    if lora.type == "loha":
        return LoHaConfig(r=lora.rank, alpha=alpha, target_modules=list(targets), **extra)
    return LoraConfig(r=lora.rank, lora_alpha=alpha, lora_dropout=lora.dropout, use_dora=lora.dora,
                      init_lora_weights="gaussian", target_modules=list(targets), **extra)


def add_adapter(model: torch.nn.Module, lora, targets, *, inject: bool = False, **extra) -> None:
    """Adapt `model`'s `targets` as the `lora` section says: diffusers' `add_adapter` for a diffusers model, peft's
    `inject_adapter_in_model` (`inject`) for a transformers text encoder (transformers' own add_adapter refuses
    peft < 0.22). The caller seeds torch first: the initial weights are drawn here."""
    config = peft_config(lora, targets, **extra)
    if inject:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, model)
    else:
        model.add_adapter(config)  # type: ignore[operator]
    if lora.type == "lokr":
        _unscaled_full_lokr(model, config)


def _unscaled_full_lokr(model: torch.nn.Module, config) -> None:
    for path, layer in adapter_layers(model).items():
        if ADAPTER in layer.lokr_w1 and ADAPTER in layer.lokr_w2:
            rank = layer.r[ADAPTER]
            layer.alpha[ADAPTER], layer.scaling[ADAPTER] = rank, 1.0
            config.alpha_pattern[re.escape(path)] = rank


def adapter_layers(model: torch.nn.Module, adapter: str = ADAPTER) -> dict[str, Any]:
    """{module path: peft layer} of every layer of `model` that `adapter` (the trained one) adapts."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in model.named_modules()
            if isinstance(module, BaseTunerLayer) and adapter in _adapter_names(module)}


def _adapter_names(layer) -> set[str]:
    for attribute in ("lora_A", "lokr_w1", "lokr_w1_a", "hada_w1_a"):
        names = getattr(layer, attribute, None)
        if names:
            return set(names.keys())
    return set()


def kind(layer, adapter: str = ADAPTER) -> str:
    """"lora", "dora", "lokr" or "loha"."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer

    if isinstance(layer, LoKrLayer):
        return "lokr"
    if isinstance(layer, LoHaLayer):
        return "loha"
    return "dora" if layer.use_dora.get(adapter) else "lora"


def model_kind(model: torch.nn.Module) -> str:
    """The kind of adapter `model` carries (one per run); ValueError without one."""
    kinds = {kind(layer) for layer in adapter_layers(model).values()}
    if not kinds:
        raise ValueError(f"{type(model).__name__} has no LoRA layers (nor LoKr, LoHa): add an adapter with peft "
                         "before saving one")
    if len(kinds) != 1:
        raise ValueError(f"{type(model).__name__} carries {sorted(kinds)} adapters; expected one kind")
    return kinds.pop()


def base_weight(layer) -> torch.Tensor:
    return layer.get_base_layer().weight.detach().float()


def lora_product(layer, adapter: str = ADAPTER) -> torch.Tensor:
    """scaling * up @ down of a LoRA/DoRA layer, in the base weight's shape."""
    a, b = layer.lora_A[adapter].weight.float(), layer.lora_B[adapter].weight.float()
    shape = layer.get_base_layer().weight.shape
    return (b.flatten(1) @ a.flatten(1)).reshape(shape) * layer.scaling[adapter]


def row_norm(weight: torch.Tensor) -> torch.Tensor:
    """The norm of each output row (DoRA's, peft's and LyCORIS' `wd_on_out`), shaped to broadcast over `weight`."""
    return weight.flatten(1).norm(dim=1).reshape(-1, *[1] * (weight.dim() - 1))


def magnitude(layer, adapter: str = ADAPTER) -> torch.Tensor:
    """A DoRA layer's trained magnitude, shaped to broadcast over its weight."""
    m = layer.lora_magnitude_vector[adapter].weight.detach().float()
    return m.reshape(-1, *[1] * (layer.get_base_layer().weight.dim() - 1))


@torch.no_grad()
def delta_weight(layer, adapter: str = ADAPTER) -> torch.Tensor:
    """What `adapter` adds to the layer's weight: the adapted weight is base + this (fp32)."""
    if kind(layer, adapter) in ("lokr", "loha"):
        return layer.get_delta_weight(adapter).detach().float()
    product = lora_product(layer, adapter)
    if kind(layer, adapter) == "lora":
        return product
    weight = base_weight(layer)
    merged = weight + product
    return merged * (magnitude(layer, adapter) / row_norm(merged)) - weight
