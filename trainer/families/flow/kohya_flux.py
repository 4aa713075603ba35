"""FLUX.1 LoRA in the kohya sd-scripts / ComfyUI layout (the "BFL" module names), from a diffusers/peft LoRA.

ComfyUI, Forge and sd-scripts name FLUX LoRA modules after Black Forest Labs' reference implementation, where
attention q, k, v are one fused Linear (and a single-stream block's q, k, v and MLP input are one `linear1`):

    lora_unet_double_blocks_{i}_img_attn_qkv      <- transformer_blocks.{i}.attn.to_q / to_k / to_v
    lora_unet_double_blocks_{i}_txt_attn_qkv      <- transformer_blocks.{i}.attn.add_q_proj / add_k_proj / add_v_proj
    lora_unet_double_blocks_{i}_img_attn_proj     <- attn.to_out.0        txt_attn_proj <- attn.to_add_out
    lora_unet_double_blocks_{i}_img_mlp_0 / _2    <- ff.net.0.proj / ff.net.2   (txt_: ff_context...)
    lora_unet_double_blocks_{i}_img_mod_lin       <- norm1.linear          txt_mod_lin <- norm1_context.linear
    lora_unet_single_blocks_{i}_linear1           <- single_transformer_blocks.{i}.attn.to_q / to_k / to_v / proj_mlp
    lora_unet_single_blocks_{i}_linear2           <- proj_out              modulation_lin <- norm.linear

A fused module gets one LoRA of rank n*r: `lora_down` is the parts' down matrices stacked, `lora_up` is
block-diagonal (part j's up in rows j, columns j*r..), and `alpha` is n times the parts' alpha, so
`alpha / rank * up @ down` is exactly each part's update in its rows. Parts that were not trained are zero
blocks. This is the layout diffusers' kohya conversion recognises as "sparse" and splits back exactly, and
what ComfyUI adds to the fused weight as is. Every module has its `.alpha` (ai-toolkit #67).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from trainer.families.components.kohya import split_lora_key

DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn_proj": ("attn.to_out.0",),
    "txt_attn_proj": ("attn.to_add_out",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_mod_lin": ("norm1_context.linear",),
}
SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
TOP = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in_in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_text_embed.timestep_embedder.linear_2",
    "guidance_in_in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in_out_layer": "time_text_embed.guidance_embedder.linear_2",
    "vector_in_in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in_out_layer": "time_text_embed.text_embedder.linear_2",
    "final_layer_linear": "proj_out",
}


def _kohya_target(path: str) -> tuple[str, tuple[str, ...], int]:
    """(kohya module name, the diffusers paths fused into it, this path's index among them)."""
    m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", path)
    if m:
        table, kind = (DOUBLE, "double") if m.group(1) == "transformer_blocks" else (SINGLE, "single")
        for name, parts in table.items():
            if m.group(3) in parts:
                prefix = f"{m.group(1)}.{m.group(2)}."
                return (f"lora_unet_{kind}_blocks_{m.group(2)}_{name}", tuple(prefix + p for p in parts),
                        parts.index(m.group(3)))
    for name, diffusers_path in TOP.items():
        if path == diffusers_path:
            return f"lora_unet_{name}", (path,), 0
    raise ValueError(f"FLUX LoRA module {path!r} has no kohya/ComfyUI name (norm_out and embedders other than the "
                     "listed ones are not supported)")


def transformer_to_kohya(lora_state: Mapping[str, torch.Tensor], alphas: Mapping[str, float],
                         transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """flux_to_kohya with each layer's output width read from the trained `transformer` (FLUX.1, Kontext and
    Chroma share these names)."""
    out_features = {n: m.out_features for n, m in transformer.named_modules()
                    if isinstance(getattr(m, "out_features", None), int)}
    return flux_to_kohya(lora_state, alphas, out_features)


def flux_to_kohya(lora_state: Mapping[str, torch.Tensor], alphas: Mapping[str, float],
                  out_features: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """Kohya/ComfyUI FLUX entries from a transformer LoRA state dict (peft or diffusers keys, paths relative to
    the transformer, an optional leading `transformer.`). `alphas`: each trained module's alpha by path;
    `out_features`: output width of every module that may be part of a fused one (to fill untrained parts)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in lora_state.items():
        path, which = split_lora_key(key)
        parts.setdefault(path.removeprefix("transformer."), {})[which] = tensor
    groups: dict[str, tuple[tuple[str, ...], dict[int, str]]] = {}
    for path in parts:
        name, members, index = _kohya_target(path)
        groups.setdefault(name, (members, {}))[1][index] = path

    out: dict[str, torch.Tensor] = {}
    for name, (members, trained) in sorted(groups.items()):
        first = parts[trained[min(trained)]]
        rank, dtype = first["down"].shape[0], first["down"].dtype
        in_features = first["down"].shape[1]
        alpha = float(alphas[trained[min(trained)]])
        downs, ups = [], []
        for j, member in enumerate(members):
            if j in trained:
                p = parts[trained[j]]
                if p["down"].shape[0] != rank:
                    raise ValueError(f"{name}: the fused parts have different ranks")
                # fold a part's own alpha into its up matrix so one alpha serves the whole fused module
                ratio = float(alphas[trained[j]]) / alpha
                downs.append(p["down"].float())
                ups.append(p["up"].float() * ratio)
            else:
                downs.append(torch.zeros(rank, in_features))
                ups.append(torch.zeros(out_features[member], rank))
        n = len(members)
        up = torch.zeros(sum(u.shape[0] for u in ups), n * rank) if n > 1 else ups[0]
        if n > 1:
            row = 0
            for j, u in enumerate(ups):
                up[row:row + u.shape[0], j * rank:(j + 1) * rank] = u
                row += u.shape[0]
        out[f"{name}.lora_down.weight"] = torch.cat(downs).to(dtype).contiguous()
        out[f"{name}.lora_up.weight"] = up.to(dtype).contiguous()
        out[f"{name}.alpha"] = torch.tensor(alpha * n, dtype=torch.float32)
    return out


def flux_metadata_overrides(*, guidance_embeds: bool) -> dict[str, str]:
    """sd-scripts' FLUX values for the `ss_*` / modelspec fields that differ from SD's."""
    variant = "dev" if guidance_embeds else "schnell"
    return {
        "ss_base_model_version": "flux1",
        "ss_v2": "False",
        "modelspec.architecture": f"flux-1-{variant}/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux",
        "modelspec.prediction_type": "flow",
    }
