"""The config checks Qwen-Image and Qwen-Image-Edit share, torch-free: the FLUX keys their transformer (one kind of
block, no guidance embedding) has no use for, and the most tokens their pipeline encodes."""

from __future__ import annotations


def qwen_transformer_problems(config, title: str, pipeline: str) -> list[str]:
    """`title`: the family as the messages name it; `pipeline`: the diffusers pipeline whose limit applies."""
    p = []
    flow = config.flow
    if flow.guidance != 1.0:
        p.append(f"flow.guidance: {flow.guidance} feeds FLUX.1-dev's guidance embedding, which {title} does not "
                 "have (it samples with true CFG, sample.guidance_scale): unset flow.guidance")
    if flow.lora_blocks != "all":
        p.append(f"flow.lora_blocks: {flow.lora_blocks!r} picks FLUX's double or single blocks; {title} has one "
                 "kind (60 two-stream blocks): unset it, or name layers with flow.lora_targets")
    if flow.max_sequence_length is not None and not 1 <= flow.max_sequence_length <= 1024:
        p.append(f"flow.max_sequence_length: {flow.max_sequence_length} is outside 1..1024, the most {pipeline}")
    return p
