"""Qwen-Image's config checks, torch-free: the flow-matching ones, and the keys that mean nothing for its one kind
of block and its missing guidance embedding."""

from __future__ import annotations

from trainer.families.components.qwen_checks import qwen_transformer_problems
from trainer.families.flow.checks import flow_checks


def qwenimage_checks(config, *, check_paths: bool = True) -> list[str]:
    return flow_checks(config, check_paths=check_paths) + qwen_transformer_problems(
        config, "Qwen-Image", "QwenImagePipeline encodes")
