"""A diffusers SD3 / SD3.5 pipeline as one original-layout ``.safetensors`` (Stability's single-file layout), for
ComfyUI's "Load Checkpoint", Forge, the SD3.5 reference code, and ``StableDiffusion3Pipeline.from_single_file``.

What is written, and where diffusers' single-file loader (``diffusers/loaders/single_file_utils.py``, Apache-2.0,
https://github.com/huggingface/diffusers) reads it back:

- ``model.diffusion_model.*``: the MMDiT, the exact inverse of ``convert_sd3_transformer_checkpoint_to_diffusers``:
  ``transformer_blocks.N`` -> ``joint_blocks.N`` with an ``x_block`` (image) and a ``context_block`` (text)
  each holding a fused ``attn.qkv`` (rows q, k, v), ``attn.proj``, ``attn.ln_q/ln_k`` (qk RMS norm, SD3.5),
  ``mlp.fc1/fc2`` and ``adaLN_modulation.1``; SD3.5 Medium's second image attention is ``x_block.attn2.*``;
  ``pos_embed`` (the buffer itself), ``x_embedder.proj``, ``t_embedder.mlp.0/2``, ``y_embedder.mlp.0/2``,
  ``context_embedder``, ``final_layer.linear``. The last block's text side only conditions the image
  (diffusers' ``context_pre_only``): no ``attn.proj`` or ``mlp`` there, and its ``adaLN_modulation.1`` holds
  (shift, scale) where diffusers' ``AdaLayerNormContinuous`` holds (scale, shift), as in ``final_layer``'s;
- ``first_stage_model.*``: the VAE, through the SD mapping of ``trainer.families.components.ldm_checkpoint``;
- ``text_encoders.clip_l.transformer.*`` and ``text_encoders.clip_g.transformer.*``: both CLIPs in the
  transformers layout (``text_model.*`` plus the ``position_ids`` buffer, as for SD 1.x), which
  ``convert_ldm_clip_checkpoint`` strips the prefix from. CLIP-G keeps its ``text_projection.weight``. CLIP-L's
  pooled output enters SD3 unprojected: the layout has no place for its projection, and diffusers' reader puts
  ``torch.eye`` there (as ComfyUI and the reference code use no projection). So CLIP-L is written only when its
  projection is the identity, which it is in Stability's diffusers repositories; otherwise this raises rather
  than write a file that would load as a different model;
- ``text_encoders.t5xxl.transformer.*``: T5's own state dict, as ``convert_sd3_t5_checkpoint_to_diffusers``
  reads it, ``encoder.embed_tokens.weight`` included: transformers ties it to ``shared.weight``, but diffusers'
  reader fills each from its own key and leaves it empty without one (ComfyUI ignores the extra key).

A text encoder that is ``None`` (SD3 runs without T5) is left out, as Stability's ``sd3.5_large.safetensors``
leaves all three out (they ship as separate files; ComfyUI reads whichever of the three a checkpoint has).
diffusers tells CLIP-L from CLIP-G by width (768 and 1280 in SD3), as for SDXL.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.errors import UserError
from trainer.families.components.ldm_checkpoint import clip_to_ldm, vae_to_ldm, write_checkpoint
from trainer.families.components.original_layout import Target, linear, qkv, regroup, swap_halves

if TYPE_CHECKING:
    from diffusers import SD3Transformer2DModel

LAYOUT = "SD3"
IMPLEMENTATION = "https://github.com/Stability-AI/sd3.5"
PREFIXES = {
    "transformer": "model.diffusion_model.",
    "vae": "first_stage_model.",
    "text_encoder": "text_encoders.clip_l.transformer.",
    "text_encoder_2": "text_encoders.clip_g.transformer.",
    "text_encoder_3": "text_encoders.t5xxl.transformer.",
}
COMPONENTS = tuple(PREFIXES)

_FIXED: dict[str, Target] = {
    "pos_embed.pos_embed": ("pos_embed", 0, 1),
    **linear("pos_embed.proj", "x_embedder.proj"),
    **linear("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0"),
    **linear("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2"),
    **linear("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0"),
    **linear("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2"),
    **linear("context_embedder", "context_embedder"),
    **linear("proj_out", "final_layer.linear"),
    **linear("norm_out.linear", "final_layer.adaLN_modulation.1"),
}
_BLOCK: dict[str, Target] = {
    **qkv("attn.", ("to_q", "to_k", "to_v"), "x_block.attn.qkv"),
    **qkv("attn.", ("add_q_proj", "add_k_proj", "add_v_proj"), "context_block.attn.qkv"),
    **qkv("attn2.", ("to_q", "to_k", "to_v"), "x_block.attn2.qkv"),
    "attn.norm_q.weight": ("x_block.attn.ln_q.weight", 0, 1),
    "attn.norm_k.weight": ("x_block.attn.ln_k.weight", 0, 1),
    "attn.norm_added_q.weight": ("context_block.attn.ln_q.weight", 0, 1),
    "attn.norm_added_k.weight": ("context_block.attn.ln_k.weight", 0, 1),
    "attn2.norm_q.weight": ("x_block.attn2.ln_q.weight", 0, 1),
    "attn2.norm_k.weight": ("x_block.attn2.ln_k.weight", 0, 1),
    **linear("attn.to_out.0", "x_block.attn.proj"),
    **linear("attn.to_add_out", "context_block.attn.proj"),
    **linear("attn2.to_out.0", "x_block.attn2.proj"),
    **linear("norm1.linear", "x_block.adaLN_modulation.1"),
    **linear("norm1_context.linear", "context_block.adaLN_modulation.1"),
    **linear("ff.net.0.proj", "x_block.mlp.fc1"),
    **linear("ff.net.2", "x_block.mlp.fc2"),
    **linear("ff_context.net.0.proj", "context_block.mlp.fc1"),
    **linear("ff_context.net.2", "context_block.mlp.fc2"),
}


def _mmdit_target(key: str) -> Target:
    if m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", key):
        name, part, parts = _BLOCK[m[2]]
        return f"joint_blocks.{m[1]}.{name}", part, parts
    return _FIXED[key]


def mmdit_to_original(transformer: SD3Transformer2DModel, *,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """An ``SD3Transformer2DModel``'s weights under the original MMDiT names (no prefix), on the CPU."""
    out = regroup(transformer.state_dict(), _mmdit_target, what="SD3 transformer", layout=LAYOUT, dtype=dtype)
    last = transformer.config["num_layers"] - 1
    for key in ("final_layer.adaLN_modulation.1", f"joint_blocks.{last}.context_block.adaLN_modulation.1"):
        for param in ("weight", "bias"):
            out[f"{key}.{param}"] = swap_halves(out[f"{key}.{param}"])
    return out


def _cast(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(None if v.is_meta else "cpu", dtype if dtype and v.is_floating_point() else None)
            for k, v in state.items()}  # fmt: skip


def clip_l_to_original(text_encoder, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    state = dict(text_encoder.state_dict())
    projection = state.pop("text_projection.weight", None)
    if projection is not None and not projection.is_meta:
        eye = torch.eye(projection.shape[-1], dtype=projection.dtype, device=projection.device)  # square, as read
        if not torch.equal(projection, eye):
            raise UserError(
                "the first text encoder (CLIP-L) has a text_projection that is not the identity: SD3's single-file "
                "layout has no place for it (diffusers and ComfyUI use CLIP-L's pooled output unprojected), so the "
                "file would load as a different model. Set full.save_single_file=false and use output/diffusers/"
            )
    return clip_to_ldm(_cast(state, dtype), text_encoder.config)


def clip_g_to_original(text_encoder, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    state = dict(text_encoder.state_dict())
    if "text_projection.weight" not in state:
        raise UserError("the second text encoder has no text_projection: it must be a CLIPTextModelWithProjection")
    projection = state.pop("text_projection.weight")
    out = clip_to_ldm(_cast(state, dtype), text_encoder.config)
    out.update(_cast({"text_projection.weight": projection}, dtype))  # beside text_model.*, as in transformers
    return out


def t5_to_original(text_encoder, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = _cast(text_encoder.state_dict(), dtype)
    shared, tied = out.get("shared.weight"), out.get("encoder.embed_tokens.weight")
    if shared is not None and tied is not None and not tied.is_meta and tied.data_ptr() == shared.data_ptr():
        out["encoder.embed_tokens.weight"] = tied.clone()  # tied in transformers; a file holds each tensor once
    return out


def to_sd3_state_dict(transformer, vae, text_encoder=None, text_encoder_2=None, text_encoder_3=None, *,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The whole single-file state dict, prefixes included; text encoders that are None are left out."""
    models = {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2,
              "text_encoder_3": text_encoder_3}  # fmt: skip
    for name, model in models.items():
        if model is not None and any("lora_" in k or ".base_layer." in k for k in model.state_dict()):
            raise ValueError(f"the {name} still has LoRA layers: fuse and unload them before saving a single file")
    converters = {
        "transformer": lambda m: mmdit_to_original(m, dtype=dtype),
        "vae": lambda m: vae_to_ldm(_cast(m.state_dict(), dtype), m.config, layout=LAYOUT),
        "text_encoder": lambda m: clip_l_to_original(m, dtype),
        "text_encoder_2": lambda m: clip_g_to_original(m, dtype),
        "text_encoder_3": lambda m: t5_to_original(m, dtype),
    }
    out = {}
    for name, model in models.items():
        if model is not None:
            out.update({f"{PREFIXES[name]}{k}": v for k, v in converters[name](model).items()})
    return out


def _components(source, dtype: torch.dtype) -> dict[str, torch.nn.Module | None]:
    """The five models from a diffusers folder (loaded in ``dtype``), a pipeline, or a mapping."""
    from trainer.families.components.lora_files import unwrap

    if isinstance(source, (str, os.PathLike)):
        from diffusers import StableDiffusion3Pipeline

        folder = Path(source)
        if not (folder / "model_index.json").is_file():
            raise UserError(f"{folder} is not a diffusers pipeline folder (no model_index.json)")
        source = StableDiffusion3Pipeline.from_pretrained(folder, dtype=dtype, local_files_only=True)
    get = source.get if isinstance(source, Mapping) else lambda name: getattr(source, name, None)
    return {name: None if (model := get(name)) is None else unwrap(model) for name in COMPONENTS}


def save_sd3_single_file(
    source, out_file: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write an SD3/3.5 pipeline (folder, pipeline object, or a mapping with transformer, vae and the text encoders
    it has) as one original-layout file.

    bf16 by default, the precision SD3.5 is published in (and T5 overflows in fp16). Written to a ``.partial``
    file and renamed; returns the path written.
    """
    state = to_sd3_state_dict(**_components(source, dtype), dtype=dtype)
    header = {"modelspec.implementation": IMPLEMENTATION, **(metadata or {})}
    return write_checkpoint(state, out_file, dtype=dtype, architecture="stable-diffusion-3", metadata=header)
