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

Keys the mapping does not know raise instead of being written under a wrong name. ``regroup`` (rename + fuse
along dim 0) is shared with ``trainer.families.flow.sd3_checkpoint``; ``block_target``, ``to_original_state_dict``
and ``save_original_file`` with the layouts derived from FLUX.1's, Chroma's (``trainer.families.chroma.checkpoint``)
and FLUX.2's (``trainer.families.flux2.checkpoint``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.families.components.ldm_checkpoint import _raise_unknown, write_checkpoint

LAYOUT = "FLUX.1"
IMPLEMENTATION = "https://github.com/black-forest-labs/flux"

# (original key, part, parts): parts > 1 are concatenated along dim 0 in part order.
Target = tuple[str, int, int]


def _linear(diffusers: str, original: str, part: int = 0, parts: int = 1) -> dict[str, Target]:
    return {f"{diffusers}.{p}": (f"{original}.{p}", part, parts) for p in ("weight", "bias")}


def _qkv(prefix: str, names: tuple[str, ...], original: str) -> dict[str, Target]:
    out: dict[str, Target] = {}
    for part, name in enumerate(names):
        out.update(_linear(f"{prefix}{name}", original, part, len(names)))
    return out


_FIXED: dict[str, Target] = {
    **_linear("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
    **_linear("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
    **_linear("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
    **_linear("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
    **_linear("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
    **_linear("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer"),
    **_linear("context_embedder", "txt_in"),
    **_linear("x_embedder", "img_in"),
    **_linear("proj_out", "final_layer.linear"),
    **_linear("norm_out.linear", "final_layer.adaLN_modulation.1"),
}
DOUBLE: dict[str, Target] = {
    **_linear("norm1.linear", "img_mod.lin"),
    **_linear("norm1_context.linear", "txt_mod.lin"),
    **_qkv("attn.", ("to_q", "to_k", "to_v"), "img_attn.qkv"),
    **_qkv("attn.", ("add_q_proj", "add_k_proj", "add_v_proj"), "txt_attn.qkv"),
    "attn.norm_q.weight": ("img_attn.norm.query_norm.scale", 0, 1),
    "attn.norm_k.weight": ("img_attn.norm.key_norm.scale", 0, 1),
    "attn.norm_added_q.weight": ("txt_attn.norm.query_norm.scale", 0, 1),
    "attn.norm_added_k.weight": ("txt_attn.norm.key_norm.scale", 0, 1),
    **_linear("attn.to_out.0", "img_attn.proj"),
    **_linear("attn.to_add_out", "txt_attn.proj"),
    **_linear("ff.net.0.proj", "img_mlp.0"),
    **_linear("ff.net.2", "img_mlp.2"),
    **_linear("ff_context.net.0.proj", "txt_mlp.0"),
    **_linear("ff_context.net.2", "txt_mlp.2"),
}
SINGLE: dict[str, Target] = {
    **_linear("norm.linear", "modulation.lin"),
    **_qkv("", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear1"),
    "attn.norm_q.weight": ("norm.query_norm.scale", 0, 1),
    "attn.norm_k.weight": ("norm.key_norm.scale", 0, 1),
    **_linear("proj_out", "linear2"),
}
SWAPPED = ("final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias")


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """(a, b) -> (b, a) along dim 0: diffusers' (scale, shift) <-> the original (shift, scale). Its own inverse."""
    first, second = tensor.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def regroup(
    state: Mapping[str, torch.Tensor], target: Callable[[str], Target], *, what: str, layout: str,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """``state`` under its original names: ``target(key)`` gives (name, part, parts) or raises KeyError.

    Tensors go to the CPU, floating-point ones cast to ``dtype`` (when given) before they are fused, and a fused
    tensor is built as soon as its last part arrives: a 12-billion-parameter transformer then costs one copy at
    the file's precision (24 GB of bf16 for FLUX.1) next to the trained weights, not a second fp32 copy of every
    q/k/v. Casting before or after concatenating gives the same bits (rounding is elementwise).
    """
    out: dict[str, torch.Tensor] = {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    unknown = []
    for key, tensor in state.items():
        try:
            name, part, parts = target(key)
        except (KeyError, ValueError):
            unknown.append(key)
            continue
        cast = dtype if dtype is not None and tensor.is_floating_point() else None
        tensor = tensor.detach().to(None if tensor.is_meta else "cpu", cast)  # meta: layout checks, no memory
        if parts == 1:
            out[name] = tensor
            continue
        group = pending.setdefault(name, [None] * parts)
        group[part] = tensor
        complete = [t for t in group if t is not None]
        if len(complete) == parts:
            del pending[name]
            out[name] = torch.cat(complete, dim=0)
    _raise_unknown(what, unknown, layout)
    if pending:
        shown = ", ".join(sorted(pending)[:5])
        raise UserError(f"the {what} lacks some of the weights that make up {shown} in the {layout} layout")
    return out


def block_target(fixed: Mapping[str, Target], double: Mapping[str, Target],
                 single: Mapping[str, Target]) -> Callable[[str], Target]:
    """The target of a diffusers key in a BFL layout: `double` maps the inside of `transformer_blocks.N` onto
    `double_blocks.N`, `single` that of `single_transformer_blocks.N` onto `single_blocks.N`, `fixed` the rest."""

    def target(key: str) -> Target:
        if m := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", key):
            name, part, parts = double[m[2]]
            return f"double_blocks.{m[1]}.{name}", part, parts
        if m := re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.+)", key):
            name, part, parts = single[m[2]]
            return f"single_blocks.{m[1]}.{name}", part, parts
        return fixed[key]

    return target


def to_original_state_dict(transformer: torch.nn.Module, target: Callable[[str], Target], *, what: str,
                           layout: str, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """`transformer`'s state dict under `target`'s names (no prefix), the final modulation's halves swapped where
    the layout has one (FLUX.1's and FLUX.2's ``final_layer.adaLN_modulation.1``; Chroma's has no weights)."""
    state = transformer.state_dict()
    if any("lora_" in k or ".base_layer." in k for k in state):
        raise ValueError("the transformer still has LoRA layers: fuse and unload them before saving a single file")
    out = regroup(state, target, what=what, layout=layout, dtype=dtype)
    for key in SWAPPED:
        if key in out:
            out[key] = swap_halves(out[key])
    return out


_flux_target = block_target(_FIXED, DOUBLE, SINGLE)


def to_flux_state_dict(transformer: torch.nn.Module, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The BFL-layout state dict (no prefix) of a ``FluxTransformer2DModel``, on the CPU, in ``dtype`` if given."""
    return to_original_state_dict(transformer, _flux_target, what="FLUX transformer", layout=LAYOUT, dtype=dtype)


def flux_architecture(transformer) -> str:
    """ModelSpec's name (as sd-scripts writes it): dev has the guidance embedding, schnell does not."""
    return "flux-1-dev" if transformer.config.get("guidance_embeds") else "flux-1-schnell"


def load_transformer(source, dtype: torch.dtype, model_class: str = "FluxTransformer2DModel") -> torch.nn.Module:
    """A transformer module, a pipeline that has one, or a diffusers folder (pipeline or transformer alone) loaded
    as diffusers' `model_class`."""
    from trainer.families.components.lora_files import unwrap

    if isinstance(source, (str, os.PathLike)):
        import diffusers

        folder = Path(source)
        subfolder = "transformer" if (folder / "transformer" / "config.json").is_file() else None
        if subfolder is None and not (folder / "config.json").is_file():
            raise UserError(f"{folder} is neither a pipeline folder nor a transformer folder (no config.json): "
                            "give the run's output/diffusers folder")
        return getattr(diffusers, model_class).from_pretrained(folder, subfolder=subfolder, dtype=dtype,
                                                               local_files_only=True)
    return unwrap(getattr(source, "transformer", source))


def save_original_file(state: Mapping[str, torch.Tensor], out_file: str | os.PathLike, *, dtype: torch.dtype,
                       architecture: str, implementation: str, metadata: Mapping[str, str] | None = None) -> Path:
    """`state` (already in its original layout) as one file with modelspec's architecture and implementation."""
    header = {"modelspec.implementation": implementation, **(metadata or {})}
    return write_checkpoint(state, out_file, dtype=dtype, architecture=architecture, metadata=header)


def save_flux_single_file(
    source, out_file: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write a FLUX.1 transformer (module, pipeline, or diffusers folder) as one BFL-layout file.

    bf16 by default: FLUX.1 is published in bf16, and fp16's narrow range is where FLUX overflows. Written to a
    ``.partial`` file and renamed; returns the path written.
    """
    transformer = load_transformer(source, dtype)
    return save_original_file(to_flux_state_dict(transformer, dtype=dtype), out_file, dtype=dtype,
                              architecture=flux_architecture(transformer), implementation=IMPLEMENTATION,
                              metadata=metadata)
