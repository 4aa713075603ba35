"""Qwen-Image's config checks, torch-free: the flow-matching ones, and the keys that mean nothing for its one kind
of block and its missing guidance embedding."""

from __future__ import annotations

from trainer.families.flow.checks import flow_checks


def qwenimage_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flow_checks(config, check_paths=check_paths)
    flow = config.flow
    if flow.guidance != 1.0:
        p.append(f"flow.guidance: {flow.guidance} feeds FLUX.1-dev's guidance embedding, which Qwen-Image does not "
                 "have (it samples with true CFG, sample.guidance_scale): unset flow.guidance")
    if flow.lora_blocks != "all":
        p.append(f"flow.lora_blocks: {flow.lora_blocks!r} picks FLUX's double or single blocks; Qwen-Image has one "
                 "kind (60 two-stream blocks): unset it, or name layers with flow.lora_targets")
    if flow.max_sequence_length is not None and not 1 <= flow.max_sequence_length <= 1024:
        p.append(f"flow.max_sequence_length: {flow.max_sequence_length} is outside 1..1024, the most "
                 "QwenImagePipeline encodes")
    return p
