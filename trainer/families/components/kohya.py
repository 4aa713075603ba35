"""LoRA weights in the kohya sd-scripts layout, the one ComfyUI, A1111/Forge and most model sites read.

A kohya LoRA is a flat safetensors file. Every adapted module contributes three entries under one name:

    lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight   (rank, in)
    lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight     (out, rank)
    lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha              scalar

and the loader applies ``W + (alpha / rank) * up @ down``. The name is a prefix plus the module's path in the
*diffusers* model with dots turned into underscores: sd-scripts trains SD 1.x/2.x on a UNet whose module names
match diffusers', so this is its native naming, and ComfyUI's and A1111's key maps both include it. Text
encoders use ``lora_te_`` (SD 1/2) or ``lora_te1_`` / ``lora_te2_`` (SDXL), again over the transformers module
path (``text_model.encoder.layers.0.self_attn.q_proj``).

Every module's ``.alpha`` is written, always: a file without it is read as alpha == rank by ComfyUI, which
silently changes the strength of a LoRA trained with alpha != rank (ai-toolkit #67 shipped exactly that).

Metadata follows sd-scripts (``ss_*``, which A1111 reads to tell SD1 from SD2/SDXL) and Stability's ModelSpec
(``modelspec.*``). Safetensors metadata values must be strings, so everything is stringified here.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping

import torch

UNET_PREFIX = "lora_unet"
TEXT_ENCODER_PREFIX = "lora_te"  # SDXL: "lora_te1" and "lora_te2"

# Suffixes a LoRA state dict may use for the two factors: peft's own, and the two diffusers serialisations
# (UNet "lora.down" and text-encoder "lora_linear_layer.down"), so either kind of state dict can be converted.
_DOWN_SUFFIXES = (".lora_A.weight", ".lora.down.weight", ".lora_linear_layer.down.weight")
_UP_SUFFIXES = (".lora_B.weight", ".lora.up.weight", ".lora_linear_layer.up.weight")

# Architecture ids of the ModelSpec, keyed by sd-scripts' ss_base_model_version.
_ARCHITECTURES = {
    "sd_v1": "stable-diffusion-v1",
    "sd_v2": "stable-diffusion-v2-512",
    "sd_v2_v": "stable-diffusion-v2-768-v",
    "sdxl_base_v1-0": "stable-diffusion-xl-v1-base",
}


def kohya_module_name(module_path: str, prefix: str) -> str:
    """``down_blocks.0.[...].to_out.0`` -> ``lora_unet_down_blocks_0_[...]_to_out_0`` for prefix "lora_unet"."""
    return f"{prefix}_{module_path.replace('.', '_')}"


def split_lora_key(key: str) -> tuple[str, str]:
    """Split a peft/diffusers LoRA key into (module path, "down" | "up"); ValueError for anything else.

    Biases, DoRA magnitudes and embedding LoRAs have no place in the classic kohya format, so they are refused
    rather than dropped: a file missing part of what was trained would load and look fine, and be wrong.
    """
    for suffix in _DOWN_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], "down"
    for suffix in _UP_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], "up"
    raise ValueError(
        f"cannot convert LoRA key {key!r} to the kohya format: only plain LoRA down/up weights are supported "
        "(no DoRA, LoRA biases or embedding LoRA)"
    )


def clip_module_path(module_path: str) -> str:
    """The CLIP text-model path kohya names use, whichever transformers version produced the state dict.

    transformers 5 flattened ``CLIPTextModel`` (``encoder.layers.0...`` instead of ``text_model.encoder...``);
    every kohya-format reader expects the ``text_model_`` part, so it is put back.
    """
    return module_path if module_path.startswith("text_model.") else f"text_model.{module_path}"


def convert_lora_state(
    lora_state: Mapping[str, torch.Tensor],
    *,
    prefix: str,
    alpha: float | Mapping[str, float],
    path_fn=None,
) -> dict[str, torch.Tensor]:
    """Convert one model's LoRA state dict (peft or diffusers keys) to kohya entries under ``prefix``.

    ``alpha`` is one value for every module, or a mapping from kohya module name (``lora_unet_...``) to its
    alpha for LoRAs whose modules differ. ``path_fn`` rewrites module paths first (``clip_module_path`` for
    text encoders). Call it once per model: SDXL is ``prefix="lora_te1"`` and ``"lora_te2"`` for its two
    text encoders. Tensors are detached, moved to the CPU and made contiguous, ready for safetensors.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in lora_state.items():
        path, part = split_lora_key(key)
        if path_fn is not None:
            path = path_fn(path)
        pairs.setdefault(kohya_module_name(path, prefix), {})[part] = tensor

    out: dict[str, torch.Tensor] = {}
    for name, parts in sorted(pairs.items()):
        if set(parts) != {"down", "up"}:
            raise ValueError(f"LoRA module {name} has only its {'/'.join(parts)} weight; both down and up are needed")
        down, up = parts["down"], parts["up"]
        if down.shape[0] != up.shape[1]:
            shapes = f"down {tuple(down.shape)} and up {tuple(up.shape)}"
            raise ValueError(f"LoRA module {name}: {shapes} disagree on the rank")
        if isinstance(alpha, Mapping):
            if name not in alpha:
                raise ValueError(f"no alpha given for LoRA module {name}")
            value = float(alpha[name])
        else:
            value = float(alpha)
        out[f"{name}.lora_down.weight"] = down.detach().to("cpu").contiguous()
        out[f"{name}.lora_up.weight"] = up.detach().to("cpu").contiguous()
        # fp32 whatever the weights are: sd-scripts casts alpha to the save dtype, but fp16 would round some
        # alphas (e.g. 0.1), and every reader takes .item() anyway.
        out[f"{name}.alpha"] = torch.tensor(value, dtype=torch.float32)
    return out


def to_kohya(
    unet_lora_state: Mapping[str, torch.Tensor] | None,
    text_encoder_lora_state: Mapping[str, torch.Tensor] | None = None,
    *,
    alpha: float | Mapping[str, float],
    unet_prefix: str = UNET_PREFIX,
    text_encoder_prefix: str = TEXT_ENCODER_PREFIX,
) -> dict[str, torch.Tensor]:
    """Kohya state dict of an SD 1.x/2.x LoRA: UNet under ``lora_unet_``, CLIP text encoder under ``lora_te_``.

    Inputs are peft state dicts (``get_peft_model_state_dict``) or their diffusers conversions, with module paths
    relative to the UNet / text encoder. See ``convert_lora_state`` for ``alpha``.
    """
    out: dict[str, torch.Tensor] = {}
    if unet_lora_state:
        out.update(convert_lora_state(unet_lora_state, prefix=unet_prefix, alpha=alpha))
    if text_encoder_lora_state:
        te = convert_lora_state(
            text_encoder_lora_state, prefix=text_encoder_prefix, alpha=alpha, path_fn=clip_module_path
        )
        out.update(te)
    if not out:
        raise ValueError("no LoRA weights to convert: both the UNet and the text encoder state dicts are empty")
    return out


def kohya_metadata(
    *,
    rank: int,
    alpha: float,
    name: str = "lora",
    base_model_version: str = "sd_v1",
    prediction_type: str = "epsilon",
    train_text_encoder: bool = False,
    steps: int | None = None,
    base_model: str | None = None,
    resolution: int | tuple[int, int] | None = None,
    comment: str | None = None,
    title: str | None = None,
    date: datetime.datetime | None = None,
    extra: Mapping[str, object] | None = None,
) -> dict[str, str]:
    """sd-scripts ``ss_*`` and ModelSpec ``modelspec.*`` metadata for a LoRA file; every value a string.

    ``base_model_version`` uses sd-scripts' values: ``sd_v1``, ``sd_v2`` or ``sdxl_base_v1-0``. ``extra`` keys
    that already start with ``ss_`` or ``modelspec.`` are kept as they are, others are stored as ``ss_<key>``.
    """
    v_pred = prediction_type in ("v_prediction", "v")
    arch_key = "sd_v2_v" if base_model_version == "sd_v2" and v_pred else base_model_version
    architecture = _ARCHITECTURES.get(arch_key, base_model_version)
    when = date or datetime.datetime.now().replace(microsecond=0)
    if resolution is None:
        resolution = 768 if arch_key == "sd_v2_v" else 1024 if base_model_version.startswith("sdxl") else 512
    width, height = (resolution, resolution) if isinstance(resolution, int) else resolution

    meta: dict[str, object] = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": int(rank),
        "ss_network_alpha": float(alpha),
        "ss_network_train_unet_only": not train_text_encoder,
        "ss_base_model_version": base_model_version,
        "ss_v2": base_model_version.startswith("sd_v2"),
        "ss_v_parameterization": v_pred,
        "ss_output_name": name,
        "ss_resolution": f"({width}, {height})",
        "ss_training_finished_at": int(when.timestamp()),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{architecture}/lora",
        # sd-scripts writes "diffusers" for SD 1/2 LoRAs: the module names are diffusers'.
        "modelspec.implementation": "diffusers",
        "modelspec.title": title or name,
        "modelspec.date": when.isoformat(),
        "modelspec.resolution": f"{width}x{height}",
        "modelspec.prediction_type": "v" if v_pred else "epsilon",
    }
    if steps is not None:
        meta["ss_steps"] = int(steps)
    if base_model is not None:
        meta["ss_sd_model_name"] = base_model
    if comment is not None:
        meta["ss_training_comment"] = comment
    for key, value in (extra or {}).items():
        meta[key if key.startswith(("ss_", "modelspec.")) else f"ss_{key}"] = value
    return {key: str(value) for key, value in meta.items() if value is not None}
