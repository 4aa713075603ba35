"""A diffusers SDXL pipeline as one original-layout (SGM) ``.safetensors`` for A1111, ComfyUI, Forge.

The layout is that of Stability's ``sd_xl_base_1.0.safetensors``, as diffusers'
``scripts/convert_diffusers_to_original_sdxl.py`` (Apache-2.0, https://github.com/huggingface/diffusers) writes
it and ``diffusers.loaders.single_file_utils`` reads it back:

- ``model.diffusion_model.*``: the UNet, through the SD 1.x mapping of ``trainer.families.components.ldm_checkpoint`` (block
  indices from the config, transformer depth kept as ``transformer_blocks.N``) plus SDXL's size/crop embedding,
  ``add_embedding.linear_1/2`` -> ``label_emb.0.0/label_emb.0.2``;
- ``first_stage_model.*``: the VAE, as for SD 1.x;
- ``conditioner.embedders.0.transformer.*``: text encoder 1 (CLIP ViT-L) in the transformers layout, as SD 1.x's;
- ``conditioner.embedders.1.model.*``: text encoder 2 (OpenCLIP ViT-bigG, ``CLIPTextModelWithProjection`` in
  diffusers) back in OpenCLIP's layout: ``transformer.resblocks.N.attn.in_proj_weight/bias`` (q, k, v
  concatenated in that order), ``attn.out_proj``, ``ln_1``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``,
  ``token_embedding.weight``, ``positional_embedding``, ``ln_final`` and ``text_projection``, stored transposed
  (OpenCLIP computes ``x @ text_projection``; diffusers' ``convert_open_clip_checkpoint`` reads it back with ``.T``).

Keys a mapping does not know raise instead of being written under a wrong name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.families.components.ldm_checkpoint import _raise_unknown, clip_to_ldm, unet_to_ldm, vae_to_ldm, write_checkpoint

LAYOUT = "SDXL"
UNET_EXTRA = {"add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2"}
PREFIXES = {
    "unet": "model.diffusion_model.",
    "vae": "first_stage_model.",
    "text_encoder": "conditioner.embedders.0.transformer.",
    "text_encoder_2": "conditioner.embedders.1.model.",
}
COMPONENTS = tuple(PREFIXES)

_OPEN_CLIP_FIXED = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}
_OPEN_CLIP_LAYER = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
                    "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}  # fmt: skip
_QKV = ("q", "k", "v")  # the order of torch.nn.MultiheadAttention's in_proj, which OpenCLIP uses


def open_clip_to_ldm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers ``CLIPTextModelWithProjection`` weights -> OpenCLIP text-tower names (no prefix)."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in state.items():
        if key == "text_projection.weight":
            out["text_projection"] = tensor.T.contiguous()  # nn.Linear's (out, in) -> OpenCLIP's (in, out)
            continue
        name = key.removeprefix("text_model.")
        if name == "embeddings.position_ids":  # a transformers buffer (arange); OpenCLIP has none
            continue
        if name in _OPEN_CLIP_FIXED:
            out[_OPEN_CLIP_FIXED[name]] = tensor
        elif m := re.fullmatch(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", name):
            qkv.setdefault((int(m[1]), m[3]), {})[m[2]] = tensor
        elif (m := re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", name)) and m[2] in _OPEN_CLIP_LAYER:
            out[f"transformer.resblocks.{m[1]}.{_OPEN_CLIP_LAYER[m[2]]}.{m[3]}"] = tensor
        else:
            unknown.append(key)
    _raise_unknown("second text encoder", unknown, LAYOUT)
    for (layer, param), parts in sorted(qkv.items()):
        if set(parts) != set(_QKV):
            raise UserError(f"the second text encoder's layer {layer} lacks some of its q/k/v {param}s")
        out[f"transformer.resblocks.{layer}.attn.in_proj_{param}"] = torch.cat([parts[p] for p in _QKV])
    if "text_projection" not in out:
        raise UserError("the second text encoder has no text_projection: it must be a CLIPTextModelWithProjection")
    return out


def _components(source, dtype: torch.dtype | None = None) -> dict[str, torch.nn.Module]:
    """The four models from a diffusers folder (loaded in ``dtype``: the same rounding as casting afterwards, at
    half the memory for fp16), a pipeline, or a mapping with the four keys of COMPONENTS."""
    from trainer.families.components.lora_files import unwrap

    if isinstance(source, (str, os.PathLike)):
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        folder = Path(source)
        if not (folder / "model_index.json").is_file():
            raise UserError(f"{folder} is not a diffusers pipeline folder (no model_index.json)")
        classes = {"unet": UNet2DConditionModel, "vae": AutoencoderKL, "text_encoder": CLIPTextModel,
                   "text_encoder_2": CLIPTextModelWithProjection}  # fmt: skip
        kwargs = {"local_files_only": True}
        return {name: cls.from_pretrained(folder, subfolder=name, dtype=dtype, **kwargs)
                for name, cls in classes.items()}  # fmt: skip
    get = source.__getitem__ if isinstance(source, Mapping) else lambda name: getattr(source, name)
    return {name: unwrap(get(name)) for name in COMPONENTS}


def to_sdxl_state_dict(unet, vae, text_encoder, text_encoder_2) -> dict[str, torch.Tensor]:
    """The whole SDXL single-file state dict, prefixes included, tensors as the models hold them."""
    models = {"unet": unet, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2}
    states = {name: model.state_dict() for name, model in models.items()}
    for name, state in states.items():
        if any("lora_" in k or ".base_layer." in k for k in state):
            raise ValueError(f"the {name} still has LoRA layers: fuse and unload them before saving a single file")
    if unet.config.get("addition_embed_type") != "text_time":
        raise UserError("this UNet is not an SDXL one (no text_time addition embedding); it cannot be saved as SDXL")
    converted = {
        "unet": unet_to_ldm(states["unet"], unet.config, fixed=UNET_EXTRA, layout=LAYOUT),
        "vae": vae_to_ldm(states["vae"], vae.config, layout=LAYOUT),
        "text_encoder": clip_to_ldm(states["text_encoder"], text_encoder.config),
        "text_encoder_2": open_clip_to_ldm(states["text_encoder_2"]),
    }
    return {f"{PREFIXES[name]}{k}": v for name, state in converted.items() for k, v in state.items()}


def save_sdxl_single_file(
    pipeline_dir_or_components,
    out_file: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float16,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write an SDXL pipeline (folder, pipeline object, or a mapping with unet, vae, text_encoder and
    text_encoder_2) as one SGM-layout file.

    Floating-point weights are cast to ``dtype`` (fp16, what A1111/ComfyUI users expect); integer buffers are
    kept. Returns the path written; a reader never sees a half-written file.
    """
    models = _components(pipeline_dir_or_components, dtype)
    return write_checkpoint(to_sdxl_state_dict(**models), out_file, dtype=dtype,
                            architecture="stable-diffusion-xl-v1-base", metadata=metadata)
