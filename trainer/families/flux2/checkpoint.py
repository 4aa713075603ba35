"""A diffusers FLUX.2 transformer ([dev] or [klein]) as one ``.safetensors`` in Black Forest Labs' layout, the
one of ``flux2-dev.safetensors`` and klein's ``flux-2-klein-*.safetensors``: ComfyUI's "Load Diffusion Model"
(its Flux2 is its Flux model, comfy/model_base.py ``class Flux2(Flux)``) with the base model's VAE and text
encoder beside it, BFL's reference code (github.com/black-forest-labs/flux2), and
``Flux2Transformer2DModel.from_single_file``.

The mapping is the exact inverse of diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers`` (diffusers
0.42, ``loaders/single_file_utils.py`` lines 3852-4014), FLUX.1's BFL names (as ``trainer.families.flow
.flux_checkpoint``) where FLUX.2 keeps them:

- ``img_in`` / ``txt_in``, ``time_in`` / ``guidance_in`` (``in_layer`` / ``out_layer``; klein has no guidance
  embedding) for ``x_embedder``, ``context_embedder`` and ``time_guidance_embed``'s MLPs (lines 3853-3872);
- the modulations shared by all blocks of a kind keep their names, ``.lin`` for diffusers' ``.linear``
  (``double_stream_modulation_img`` / ``_txt``, ``single_stream_modulation``);
- ``double_blocks.N``: fused ``img_attn.qkv`` / ``txt_attn.qkv`` (rows q, k, v, lines 3961-3975), ``*.norm
  .query_norm.scale`` / ``key_norm.scale``, ``img_attn.proj`` / ``txt_attn.proj``, and the gated MLPs' ``img_mlp.0``
  / ``img_mlp.2`` for ``ff.linear_in`` / ``linear_out`` (lines 3875-3887);
- ``single_blocks.N``: ``linear1`` is diffusers' already fused ``attn.to_qkv_mlp_proj``, ``linear2`` its
  ``attn.to_out`` (lines 3889-3894);
- ``final_layer.linear`` is ``proj_out``; ``final_layer.adaLN_modulation.1`` is ``norm_out.linear`` with its
  halves swapped (BFL's (shift, scale), lines 3924-3937).
FLUX.2's linear layers have no biases; any other weight the layout has no place for raises. ComfyUI and diffusers
tell the file from FLUX.1's by ``double_stream_modulation_img.lin.weight`` (comfy/model_detection.py
``detect_unet_config``; single_file_utils.py ``CHECKPOINT_KEY_NAMES["flux2"]``) and size the model from its shapes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer.families.components.original_layout import (
    Target,
    linear,
    qkv,
    block_target,
    load_transformer,
    save_original_file,
    to_original_state_dict,
)

LAYOUT = "FLUX.2"
IMPLEMENTATION = "https://github.com/black-forest-labs/flux2"


_FIXED: dict[str, Target] = {
    **linear("x_embedder", "img_in"),
    **linear("context_embedder", "txt_in"),
    **linear("time_guidance_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    **linear("time_guidance_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    **linear("time_guidance_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    **linear("time_guidance_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    **linear("double_stream_modulation_img.linear", "double_stream_modulation_img.lin"),
    **linear("double_stream_modulation_txt.linear", "double_stream_modulation_txt.lin"),
    **linear("single_stream_modulation.linear", "single_stream_modulation.lin"),
    **linear("proj_out", "final_layer.linear"),
    # swapped halves (to_original_state_dict); a weight only: the converter maps no bias here (lines 3925-3927)
    "norm_out.linear.weight": ("final_layer.adaLN_modulation.1.weight", 0, 1),
}
_DOUBLE: dict[str, Target] = {
    **qkv("attn.", ("to_q", "to_k", "to_v"), "img_attn.qkv"),
    **qkv("attn.", ("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv"),
    "attn.norm_q.weight": ("img_attn.norm.query_norm.scale", 0, 1),
    "attn.norm_k.weight": ("img_attn.norm.key_norm.scale", 0, 1),
    "attn.norm_added_q.weight": ("txt_attn.norm.query_norm.scale", 0, 1),
    "attn.norm_added_k.weight": ("txt_attn.norm.key_norm.scale", 0, 1),
    **linear("attn.to_out.0", "img_attn.proj"),
    **linear("attn.to_add_out", "txt_attn.proj"),
    **linear("ff.linear_in", "img_mlp.0"),
    **linear("ff.linear_out", "img_mlp.2"),
    **linear("ff_context.linear_in", "txt_mlp.0"),
    **linear("ff_context.linear_out", "txt_mlp.2"),
}
_SINGLE: dict[str, Target] = {
    **linear("attn.to_qkv_mlp_proj", "linear1"),
    **linear("attn.to_out", "linear2"),
    "attn.norm_q.weight": ("norm.query_norm.scale", 0, 1),
    "attn.norm_k.weight": ("norm.key_norm.scale", 0, 1),
}
_flux2_target = block_target(_FIXED, _DOUBLE, _SINGLE)


def to_flux2_state_dict(transformer: torch.nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The BFL-layout state dict (no prefix) of a ``Flux2Transformer2DModel``, on the CPU."""
    return to_original_state_dict(transformer, _flux2_target, what="FLUX.2 transformer", layout=LAYOUT, dtype=dtype)


def save_flux2_single_file(source, out_file: str | os.PathLike, *, architecture: str,
                           dtype: torch.dtype = torch.bfloat16, metadata: Mapping[str, str] | None = None) -> Path:
    """Write a FLUX.2 transformer (module, pipeline, or diffusers folder) as one BFL-layout file; bf16 as BFL
    publish it. `architecture`: modelspec's name for the model (the family's)."""
    transformer = load_transformer(source, dtype, "Flux2Transformer2DModel")
    return save_original_file(to_flux2_state_dict(transformer, dtype=dtype), out_file, dtype=dtype,
                              architecture=architecture, implementation=IMPLEMENTATION, metadata=metadata)
