"""Z-Image's config checks, torch-free: the flow-matching ones, and the keys that mean nothing for a single-stream
transformer without a guidance embedding."""

from __future__ import annotations

from trainer.families.flow.checks import flow_checks


def zimage_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flow_checks(config, check_paths=check_paths)
    if config.flow.guidance != 1.0:
        p.append(f"flow.guidance: {config.flow.guidance} feeds FLUX.1-dev's guidance embedding, which Z-Image does "
                 "not have (Turbo samples without guidance, the base model with sample.guidance_scale): unset "
                 "flow.guidance")
    if config.flow.lora_blocks != "all":
        # Every Z-Image block is a single-stream block over text and image tokens: FLUX's split has no meaning.
        p.append(f"flow.lora_blocks: {config.flow.lora_blocks} picks FLUX's double or single blocks; Z-Image has "
                 "one kind of block: unset it, or choose layers with flow.lora_targets")
    return p
