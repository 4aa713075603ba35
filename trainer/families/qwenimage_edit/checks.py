"""Qwen-Image-Edit's config checks, torch-free: the flow-matching ones, its paired data (data.control_path), the
FLUX keys its transformer has no use for, and mirrored pairs (its text encoder reads the control image)."""

from __future__ import annotations

from trainer.core.data.sources import sources
from trainer.families.components.dataset_checks import control_path_problems
from trainer.families.flow.checks import flow_checks


def qwenimage_edit_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flow_checks(config, check_paths=check_paths) + control_path_problems(config, "qwenimage_edit",
                                                                            check_paths=check_paths)
    flow = config.flow
    if flow.guidance != 1.0:
        p.append(f"flow.guidance: {flow.guidance} feeds FLUX.1-dev's guidance embedding, which Qwen-Image-Edit does "
                 "not have (it samples with true CFG, sample.guidance_scale): unset flow.guidance")
    if flow.lora_blocks != "all":
        p.append(f"flow.lora_blocks: {flow.lora_blocks!r} picks FLUX's double or single blocks; Qwen-Image-Edit has "
                 "one kind (60 two-stream blocks): unset it, or name layers with flow.lora_targets")
    if flow.max_sequence_length is not None and not 1 <= flow.max_sequence_length <= 1024:
        p.append(f"flow.max_sequence_length: {flow.max_sequence_length} is outside 1..1024, the most "
                 "QwenImageEditPlusPipeline takes (its vision tokens count)")
    if any(source.flip for source in sources(config.data)):
        p.append("data.flip: Qwen-Image-Edit's text encoder (Qwen2.5-VL) reads the control image with the "
                 "instruction, so a mirrored pair would need its own text embedding and an instruction that may say "
                 "left or right: set data.flip=false (and flip: false in data.datasets entries), or add mirrored "
                 "pairs as files")
    return p
