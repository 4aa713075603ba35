"""A diffusers FLUX.1 transformer as one ``.safetensors`` in Black Forest Labs' original layout, the one of
``flux1-dev.safetensors`` / ``flux1-schnell.safetensors``: what ComfyUI's "Load Diffusion Model", Forge and the
reference code load, with the base model's VAE (``ae.safetensors``) and text encoders (CLIP-L, T5-XXL) beside it.

The mapping is the exact inverse of diffusers' ``convert_flux_transformer_checkpoint_to_diffusers``
(``diffusers/loaders/single_file_utils.py``, Apache-2.0, https://github.com/huggingface/diffusers), which is
how diffusers (``FluxTransformer2DModel.from_single_file``) reads such a file:

- no prefix; ``time_in``, ``vector_in``, ``guidance_in`` (dev only: schnell has no guidance embedding) hold
  ``time_text_embed``'s three two-layer MLPs as ``in_layer`` / ``out_layer``; ``img_in`` / ``txt_in`` are
  ``x_embedder`` / ``context_embedder``;
- ``double_blocks.N`` (diffusers ``transformer_blocks.N``): the image stream's q, k, v are one fused
  ``img_attn.qkv`` (rows q, k, v, in that order), the text stream's ``add_{q,k,v}_proj`` one ``txt_attn.qkv``;
  RMS-norm weights are ``...norm.query_norm.scale`` / ``key_norm.scale``; ``img_mod.lin`` / ``txt_mod.lin`` are
  ``norm1`` / ``norm1_context``; ``img_mlp.0/2``, ``txt_mlp.0/2``, ``img_attn.proj``, ``txt_attn.proj``;
- ``single_blocks.N`` (``single_transformer_blocks.N``): ``linear1`` is q, k, v and the MLP input projection
  (``proj_mlp``) stacked in that order, ``linear2`` is ``proj_out``, ``modulation.lin`` is ``norm.linear``;
- ``final_layer.linear`` is ``proj_out``; ``final_layer.adaLN_modulation.1`` is ``norm_out.linear`` with its two
  halves swapped: BFL's final modulation computes (shift, scale), diffusers' ``AdaLayerNormContinuous``
  (scale, shift).

Keys the mapping does not know raise instead of being written under a wrong name. The renaming and fusing is
``trainer.families.components.original_layout``'s; Chroma's layout (``trainer.families.chroma.checkpoint``) reuses
``DOUBLE`` and ``SINGLE`` below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer.families.components.original_layout import (
    Target,
    block_target,
    linear,
    load_transformer,
    qkv,
    save_original_file,
    to_original_state_dict,
)

LAYOUT = "FLUX.1"
IMPLEMENTATION = "https://github.com/black-forest-labs/flux"

_FIXED: dict[str, Target] = {
    **linear("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    **linear("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    **linear("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    **linear("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    **linear("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    **linear("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    **linear("context_embedder", "txt_in"),
    **linear("x_embedder", "img_in"),
    **linear("proj_out", "final_layer.linear"),
    **linear("norm_out.linear", "final_layer.adaLN_modulation.1"),
}
DOUBLE: dict[str, Target] = {
    **linear("norm1.linear", "img_mod.lin"),
    **linear("norm1_context.linear", "txt_mod.lin"),
    **qkv("attn.", ("to_q", "to_k", "to_v"), "img_attn.qkv"),
    **qkv("attn.", ("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv"),
    "attn.norm_q.weight": ("img_attn.norm.query_norm.scale", 0, 1),
    "attn.norm_k.weight": ("img_attn.norm.key_norm.scale", 0, 1),
    "attn.norm_added_q.weight": ("txt_attn.norm.query_norm.scale", 0, 1),
    "attn.norm_added_k.weight": ("txt_attn.norm.key_norm.scale", 0, 1),
    **linear("attn.to_out.0", "img_attn.proj"),
    **linear("attn.to_add_out", "txt_attn.proj"),
    **linear("ff.net.0.proj", "img_mlp.0"),
    **linear("ff.net.2", "img_mlp.2"),
    **linear("ff_context.net.0.proj", "txt_mlp.0"),
    **linear("ff_context.net.2", "txt_mlp.2"),
}
SINGLE: dict[str, Target] = {
    **linear("norm.linear", "modulation.lin"),
    **qkv("", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear1"),
    "attn.norm_q.weight": ("norm.query_norm.scale", 0, 1),
    "attn.norm_k.weight": ("norm.key_norm.scale", 0, 1),
    **linear("proj_out", "linear2"),
}
_flux_target = block_target(_FIXED, DOUBLE, SINGLE)


def to_flux_state_dict(transformer: torch.nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The BFL-layout state dict (no prefix) of a ``FluxTransformer2DModel``, on the CPU, in ``dtype`` if given."""
    return to_original_state_dict(transformer, _flux_target, what="FLUX transformer", layout=LAYOUT, dtype=dtype)


def flux_architecture(transformer) -> str:
    """ModelSpec's name (as sd-scripts writes it): dev has the guidance embedding, schnell does not."""
    return "flux-1-dev" if transformer.config.get("guidance_embeds") else "flux-1-schnell"


def save_flux_single_file(
    source, out_file: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a FLUX.1 transformer (module, pipeline, or diffusers folder) as one BFL-layout file.

    bf16 by default: FLUX.1 is published in bf16, and fp16's narrow range is where FLUX overflows. Written to a
    ``.partial`` file and renamed; returns the path written.
    """
    transformer = load_transformer(source, dtype, "FluxTransformer2DModel")
    return save_original_file(to_flux_state_dict(transformer, dtype=dtype), out_file, dtype=dtype,
                              architecture=flux_architecture(transformer), implementation=IMPLEMENTATION,
                              metadata=metadata)
