"""A diffusers Chroma transformer as one ``.safetensors`` in its original layout, the one lodestones publish
(``Chroma1-HD.safetensors``, ``Chroma1-Base.safetensors``): ComfyUI's "Load Diffusion Model" (its Chroma is its
Flux model, comfy/model_base.py ``class Chroma(Flux)``) with FLUX.1's VAE and T5-XXL beside it, and
``ChromaTransformer2DModel.from_single_file``.

The mapping is the exact inverse of diffusers' ``convert_chroma_transformer_checkpoint_to_diffusers``
(diffusers 0.42, ``loaders/single_file_utils.py`` lines 3570-3736): FLUX.1's BFL names for the blocks
(``trainer.families.flow.flux_checkpoint``: fused ``img_attn.qkv`` / ``txt_attn.qkv``, ``linear1`` = q, k, v and
the MLP input, ``linear2``), without what Chroma pruned: no per-block modulation (``img_mod``, ``txt_mod``,
``modulation``), no ``time_in`` / ``vector_in`` / ``guidance_in``, and a final layer with ``linear`` only (lines
3733-3734). In their place the distilled guidance layer, under its own name (lines 3594-3622):
``in_proj`` / ``out_proj`` as they are, ``layers.N.in_layer`` / ``out_layer`` for diffusers' ``linear_1`` /
``linear_2``, and RMS-norm ``norms.N.scale`` for ``norms.N.weight``. ComfyUI tells the file from FLUX.1's by
``distilled_guidance_layer.norms.0.scale`` beside ``double_blocks.0.img_attn.norm.key_norm.scale``
(comfy/model_detection.py ``detect_unet_config``); diffusers by ``distilled_guidance_layer.in_proj.bias``
(single_file_utils.py ``CHECKPOINT_KEY_NAMES["chroma"]``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer.families.components.original_layout import (
    Target,
    block_target,
    linear,
    load_transformer,
    save_original_file,
    to_original_state_dict,
)
from trainer.families.flow.flux_checkpoint import DOUBLE, SINGLE

LAYOUT = "Chroma"
IMPLEMENTATION = "https://huggingface.co/lodestones/Chroma1-HD"

# FLUX.1's blocks less their modulation (diffusers' Chroma norms hold no weights: the guidance layer modulates)
_DOUBLE = {k: v for k, v in DOUBLE.items() if not k.startswith(("norm1.", "norm1_context."))}
_SINGLE = {k: v for k, v in SINGLE.items() if not k.startswith("norm.linear.")}
_FIXED: dict[str, Target] = {
    **linear("context_embedder", "txt_in"),
    **linear("x_embedder", "img_in"),
    **linear("proj_out", "final_layer.linear"),
    **linear("distilled_guidance_layer.in_proj", "distilled_guidance_layer.in_proj"),
    **linear("distilled_guidance_layer.out_proj", "distilled_guidance_layer.out_proj"),
}
_blocks = block_target(_FIXED, _DOUBLE, _SINGLE)


def _chroma_target(key: str) -> Target:
    # the guidance layer's MLPs and norms, converter lines 3608-3622
    if m := re.fullmatch(r"distilled_guidance_layer\.layers\.(\d+)\.linear_([12])\.(weight|bias)", key):
        return f"distilled_guidance_layer.layers.{m[1]}.{('in_layer', 'out_layer')[int(m[2]) - 1]}.{m[3]}", 0, 1
    if m := re.fullmatch(r"distilled_guidance_layer\.norms\.(\d+)\.weight", key):
        return f"distilled_guidance_layer.norms.{m[1]}.scale", 0, 1
    return _blocks(key)


def to_chroma_state_dict(transformer: torch.nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The original-layout state dict (no prefix) of a ``ChromaTransformer2DModel``, on the CPU."""
    return to_original_state_dict(transformer, _chroma_target, what="Chroma transformer", layout=LAYOUT,
                                  dtype=dtype)


def save_chroma_single_file(source, out_file: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
                            metadata: Mapping[str, str] | None = None) -> Path:
    """Write a Chroma transformer (module, pipeline, or diffusers folder) as one file in its original layout; bf16
    as lodestones publish it."""
    transformer = load_transformer(source, dtype, "ChromaTransformer2DModel")
    return save_original_file(to_chroma_state_dict(transformer, dtype=dtype), out_file, dtype=dtype,
                              architecture="chroma", implementation=IMPLEMENTATION, metadata=metadata)
