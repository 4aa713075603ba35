"""Qwen-Image-Edit's config checks, torch-free: the flow-matching ones, its paired data (data.control_path), the
FLUX keys its transformer has no use for, and mirrored pairs (its text encoder reads the control image)."""

from __future__ import annotations

from trainer.core.data.sources import sources
from trainer.families.components.dataset_checks import control_path_problems
from trainer.families.components.qwen_checks import qwen_transformer_problems
from trainer.families.flow.checks import flow_checks


def qwenimage_edit_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flow_checks(config, check_paths=check_paths) + control_path_problems(config, "qwenimage_edit",
                                                                            check_paths=check_paths)
    p += qwen_transformer_problems(config, "Qwen-Image-Edit",
                                   "QwenImageEditPlusPipeline takes (its vision tokens count)")
    if any(source.flip for source in sources(config.data)):
        p.append("data.flip: Qwen-Image-Edit's text encoder (Qwen2.5-VL) reads the control image with the "
                 "instruction, so a mirrored pair would need its own text embedding and an instruction that may say "
                 "left or right: set data.flip=false (and flip: false in data.datasets entries), or add mirrored "
                 "pairs as files")
    return p
