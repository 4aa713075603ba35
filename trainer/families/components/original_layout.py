"""Renaming and fusing a diffusers transformer's state dict into an original release's single-file layout: the
parts FLUX.1's (``trainer.families.flow.flux_checkpoint``, also FLUX.1 Kontext's), Chroma's
(``trainer.families.chroma.checkpoint``), FLUX.2's (``trainer.families.flux2.checkpoint``) and SD3's MMDiT
(``trainer.families.flow.sd3_checkpoint``) writers share.

A layout is a ``target(key) -> (original name, part, parts)`` over the diffusers keys: ``linear`` / ``qkv`` build
its entries, ``block_target`` the one of Black Forest Labs' double/single-block transformers, ``regroup`` applies
it (fusing parts along dim 0) and raises on a key the layout has no place for, so nothing is written under a wrong
name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from trainer.errors import UserError
from trainer.families.components.ldm_checkpoint import _raise_unknown, write_checkpoint

# (original key, part, parts): parts > 1 are concatenated along dim 0 in part order.
Target = tuple[str, int, int]


def linear(diffusers: str, original: str, part: int = 0, parts: int = 1) -> dict[str, Target]:
    """A linear layer's weight and bias under `original`'s name (as part `part` of `parts` when fused)."""
    return {f"{diffusers}.{p}": (f"{original}.{p}", part, parts) for p in ("weight", "bias")}


def qkv(prefix: str, names: tuple[str, ...], original: str) -> dict[str, Target]:
    """The layers `names` (under `prefix`) fused into `original` in that order, as q, k, v are into one qkv."""
    out: dict[str, Target] = {}
    for part, name in enumerate(names):
        out.update(linear(f"{prefix}{name}", original, part, len(names)))
    return out


# Black Forest Labs' final modulation (FLUX.1, FLUX.2) computes (shift, scale), diffusers' AdaLayerNormContinuous
# (scale, shift): to_original_state_dict swaps the halves of these where a layout has them
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


def load_transformer(source, dtype: torch.dtype, model_class: str) -> torch.nn.Module:
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
