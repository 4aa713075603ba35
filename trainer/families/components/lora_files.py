"""The final LoRA artifacts of an SD 1.x/2.x run: a diffusers file and a kohya/ComfyUI/A1111 copy.

``save_lora`` writes, into ``out_dir``:

- ``pytorch_lora_weights.safetensors``, diffusers' format, made the way diffusers' official DreamBooth LoRA
  example makes it (``get_peft_model_state_dict`` -> ``convert_state_dict_to_diffusers`` ->
  ``StableDiffusionPipeline.save_lora_weights``), so ``pipe.load_lora_weights(out_dir)`` loads it;
- ``<name>_kohya.safetensors``, the same weights in kohya's layout with ``ss_*`` / ``modelspec.*`` metadata
  (see ``trainer.families.components.kohya``).

Alpha is the part that silently goes wrong. A diffusers-format file has no alpha tensors; without more,
``load_lora_weights`` assumes alpha == rank, so a LoRA trained with alpha=8, rank=4 would load at half strength.
diffusers (>= 0.34) reads a ``lora_adapter_metadata`` JSON entry from the file's header and builds the
``LoraConfig`` from it (``unet_lora_adapter_metadata=`` / ``text_encoder_lora_adapter_metadata=`` of
``save_lora_weights``). The official example dumps ``peft_config.to_dict()`` there; we write only the fields
that decide the result (rank, alpha, per-module patterns, exact target paths), because that dict is splatted into
``LoraConfig(**...)`` and a field a reader's older peft does not know (every peft release adds some) makes
loading fail outright. Alphas are taken from each LoRA layer's live ``scaling`` (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA), so the files reproduce what the model computed whatever the peft config was.
"""

from __future__ import annotations

import collections
import math
import os
import re
from collections.abc import Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.families.components.adapters import model_kind
from trainer.families.components.kohya import (
    TEXT_ENCODER_PREFIX,
    UNET_PREFIX,
    clip_module_path,
    kohya_metadata,
    kohya_module_name,
    to_kohya,
)
from trainer.families.components.lycoris_files import kohya_tensors, save_peft_folders, write_file

DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_T = TypeVar("_T", bound=Hashable)

# Friendly keys of save_lora's ``metadata`` that kohya_metadata takes as arguments; the rest go to ``extra``.
_METADATA_ARGS = (
    "base_model_version", "prediction_type", "steps", "base_model", "resolution", "comment", "title", "date"
)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model under DDP/FSDP (``.module``), ``torch.compile`` (``._orig_mod``) and peft's ``PeftModel``.

    Deliberately not accelerate's ``unwrap_model(keep_fp32_wrapper=False)``: that strips the autocast wrapper
    from the live training model for good (see PITFALLS, Precision), and export runs mid-training at checkpoints.
    """
    from peft import PeftModel

    while True:
        if hasattr(model, "_orig_mod"):
            model = model.get_submodule("_orig_mod")
        elif isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) or (
            type(model).__name__ == "FullyShardedDataParallel" and hasattr(model, "module")
        ):
            model = model.get_submodule("module")
        elif isinstance(model, PeftModel):
            model = model.get_base_model()
        else:
            return model


def _lora_modules(model: torch.nn.Module) -> tuple[str, dict[str, tuple[int, float]]]:
    """(adapter name, {module path: (rank, effective alpha)}) of the LoRA layers in ``model``.

    The effective alpha is the one a kohya/diffusers reader needs to reproduce peft's scaling:
    ``scaling * rank`` (equal to the configured alpha unless rsLoRA is on).
    """
    from peft.tuners.lora import LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer) and module.r}
    if not layers:
        raise ValueError(f"{type(model).__name__} has no LoRA layers: add them with peft before saving a LoRA")
    adapters = {a for module in layers.values() for a in module.r}
    if len(adapters) != 1:
        raise ValueError(f"{type(model).__name__} has several LoRA adapters ({sorted(adapters)}); expected one")
    adapter = adapters.pop()

    modules = {}
    for name, module in layers.items():
        rank, alpha = module.r[adapter], module.lora_alpha[adapter]
        effective = module.scaling[adapter] * rank
        # Keep the configured number when it is the same value, so "8" stays 8.0 and not 7.999999.
        modules[name] = (rank, float(alpha) if math.isclose(effective, alpha, rel_tol=1e-6) else effective)
    return adapter, modules


def _most_common(values: Iterable[_T]) -> _T:
    return collections.Counter(values).most_common(1)[0][0]


def _configured_alpha(model: torch.nn.Module, path: str, adapter: str) -> float:
    """The `lora_alpha` peft was given for the LoRA layer at `path` (one `_lora_modules` found)."""
    from peft.tuners.lora import LoraLayer

    layer = model.get_submodule(path)
    assert isinstance(layer, LoraLayer), f"{path} is not a LoRA layer"
    return layer.lora_alpha[adapter]


def diffusers_adapter_metadata(modules: Mapping[str, tuple[int, float]], *, path_fn=None, use_dora: bool = False) -> dict:
    """The ``LoraConfig`` kwargs diffusers needs to rebuild these LoRA layers with the right scaling.

    Module paths go into ``target_modules`` in full so that exactly the trained layers get a LoRA; peft matches
    them as suffixes, which is what lets one text-encoder path serve CLIP with and without ``text_model.``.
    """
    paths = {(path_fn(p) if path_fn else p): v for p, v in modules.items()}
    rank = _most_common(r for r, _ in paths.values())
    alpha = _most_common(a for _, a in paths.values())
    return {
        "r": rank,
        "lora_alpha": alpha,
        "rank_pattern": {p: r for p, (r, _) in paths.items() if r != rank},
        "alpha_pattern": {p: a for p, (_, a) in paths.items() if a != alpha},
        "target_modules": sorted(paths),
        **({"use_dora": True} if use_dora else {}),
    }


def _strip_text_model(path: str) -> str:
    return path.removeprefix("text_model.")


def _peft_state(model: torch.nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def _file_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "lora"


def save_lora(
    out_dir: str | os.PathLike,
    unet: torch.nn.Module,
    text_encoder: torch.nn.Module | None = None,
    *,
    rank: int,
    alpha: float,
    metadata: Mapping[str, Any],
) -> dict[str, Path]:
    """Write the diffusers and kohya LoRA files of ``unet`` (and ``text_encoder``) into ``out_dir``.

    ``unet`` / ``text_encoder`` carry LoRA layers added with peft, possibly wrapped in DDP or ``torch.compile``.
    ``rank`` / ``alpha`` are the run's configured values; they go into the metadata and are checked against the
    UNet's layers (the weights themselves always carry each layer's own rank and alpha). ``metadata`` holds
    ``name`` (file name and title; default "lora") and optionally ``base_model_version`` (``sd_v1``/``sd_v2``,
    else inferred from the UNet), ``prediction_type``, ``steps``, ``base_model``, ``resolution``, ``comment``,
    ``title``, ``date``; other keys are stored as ``ss_<key>``. Call it on the main process only.

    Returns ``{"diffusers": path, "kohya": path}``.
    """
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    unet = unwrap(unet)
    text_encoder = unwrap(text_encoder) if text_encoder is not None else None
    adapter_kind = model_kind(unet)
    models = {"unet": unet, **({"text_encoder": text_encoder} if text_encoder is not None else {})}
    if adapter_kind in ("lokr", "loha"):  # no diffusers LoRA file holds these: peft folders, and the kohya file
        first = save_peft_folders(out_dir, models)[0]
        kohya_path = _write_kohya(out_dir, unet, _lycoris_tensors(unet, text_encoder), rank=rank, alpha=alpha,
                                  metadata=metadata, train_text_encoder=text_encoder is not None)
        return {"peft": first.parent, "kohya": kohya_path}

    unet_adapter, unet_modules = _lora_modules(unet)
    trained_rank = _most_common(r for r, _ in unet_modules.values())
    trained_alpha = _most_common(_configured_alpha(unet, p, unet_adapter) for p in unet_modules)
    if trained_rank != rank or not math.isclose(trained_alpha, alpha):
        raise ValueError(
            f"the UNet's LoRA layers have rank {trained_rank} and alpha {trained_alpha}, but rank {rank} and "
            f"alpha {alpha} were given to save_lora"
        )
    unet_state = _peft_state(unet, unet_adapter)
    te_state: dict[str, torch.Tensor] | None = None
    te_modules: dict[str, tuple[int, float]] = {}
    if text_encoder is not None:
        te_adapter, te_modules = _lora_modules(text_encoder)
        te_state = _peft_state(text_encoder, te_adapter)
    dora = adapter_kind == "dora"

    # (a) diffusers. Text-encoder keys get "text_model." back (transformers 5 flattened CLIPTextModel): diffusers
    # 0.42 strips it again for a flattened model, while older diffusers + transformers 4 need it to find the layers.
    te_layers = None
    if te_state:
        te_state_canonical = {clip_module_path(k): v for k, v in te_state.items()}
        te_layers = convert_state_dict_to_diffusers(te_state_canonical)
    StableDiffusionPipeline.save_lora_weights(
        out_dir,
        unet_lora_layers=convert_state_dict_to_diffusers(unet_state),
        text_encoder_lora_layers=te_layers,
        weight_name=DIFFUSERS_WEIGHT_NAME,
        safe_serialization=True,
        unet_lora_adapter_metadata=diffusers_adapter_metadata(unet_modules, use_dora=dora),
        text_encoder_lora_adapter_metadata=(
            diffusers_adapter_metadata(te_modules, path_fn=_strip_text_model, use_dora=dora) if te_state else None
        ),
    )

    # (b) kohya, with every module's effective alpha so rsLoRA or per-module alphas survive too.
    if dora:
        tensors = _lycoris_tensors(unet, text_encoder)
    else:
        alphas = {kohya_module_name(p, UNET_PREFIX): a for p, (_, a) in unet_modules.items()}
        te_names = {p: kohya_module_name(clip_module_path(p), TEXT_ENCODER_PREFIX) for p in te_modules}
        alphas.update({te_names[p]: a for p, (_, a) in te_modules.items()})
        tensors = to_kohya(unet_state, te_state, alpha=alphas)
    kohya_path = _write_kohya(out_dir, unet, tensors, rank=rank, alpha=alpha, metadata=metadata,
                              train_text_encoder=bool(te_state))
    return {"diffusers": out_dir / DIFFUSERS_WEIGHT_NAME, "kohya": kohya_path}


def _lycoris_tensors(unet, text_encoder) -> dict[str, torch.Tensor]:
    return kohya_tensors((unet, lambda p: kohya_module_name(p, UNET_PREFIX)),
                         (text_encoder, lambda p: kohya_module_name(clip_module_path(p), TEXT_ENCODER_PREFIX)))


def _write_kohya(out_dir: Path, unet: Any, tensors, *, rank: int, alpha: float, metadata: Mapping[str, Any],
                 train_text_encoder: bool) -> Path:
    info = dict(metadata)
    name = str(info.pop("name", None) or "lora")
    kwargs = {key: info.pop(key) for key in _METADATA_ARGS if info.get(key) is not None}
    if "base_model_version" not in kwargs:
        # `config`: a diffusers model's, which nn.Module's attribute hints (tensors and submodules) do not cover
        cross_attention_dim = unet.config.get("cross_attention_dim")
        kwargs["base_model_version"] = "sd_v2" if cross_attention_dim == 1024 else "sd_v1"
    header = kohya_metadata(
        rank=rank, alpha=alpha, name=name, train_text_encoder=train_text_encoder, extra=info, **kwargs
    )
    return write_file(out_dir / f"{_file_name(name)}_kohya.safetensors", tensors, header)
