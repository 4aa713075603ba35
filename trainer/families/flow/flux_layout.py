"""FLUX.1's transformer layout, which Chroma keeps (diffusers' FluxTransformer2DModel and ChromaTransformer2DModel
name their layers alike): two-stream blocks (`transformer_blocks`, image and text each with attention and an
MLP) then single-stream blocks (`single_transformer_blocks`, one attention and one MLP over both). The LoRA
targets of a family of that layout, by `flow.lora_blocks`."""

from __future__ import annotations

DOUBLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                  "ff_context.net.2")
SINGLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")


def lora_targets(lora_blocks: str) -> dict[str, tuple[str, ...]]:
    """{block list attribute: layer names inside one block} for `flow.lora_blocks` all | double | single."""
    out: dict[str, tuple[str, ...]] = {}
    if lora_blocks in ("all", "double"):
        out["transformer_blocks"] = DOUBLE_TARGETS
    if lora_blocks in ("all", "single"):
        out["single_transformer_blocks"] = SINGLE_TARGETS
    return out
