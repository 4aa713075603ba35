"""Chroma's config checks, torch-free: the flow-matching ones, and the keys that mean nothing without FLUX.1-dev's
guidance embedding."""

from __future__ import annotations

from trainer.families.flow.checks import flow_checks


def chroma_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flow_checks(config, check_paths=check_paths)
    if config.flow.guidance != 1.0:
        p.append(f"flow.guidance: {config.flow.guidance} feeds FLUX.1-dev's guidance embedding, which Chroma does "
                 "not have (it samples with real guidance, sample.guidance_scale): unset flow.guidance")
    return p
