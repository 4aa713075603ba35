"""FLUX.2's config checks, torch-free: the flow-matching ones, and the sample keys its pipelines have no argument
for."""

from __future__ import annotations

from trainer.families.flow.checks import flow_checks


def flux2_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flow_checks(config, check_paths=check_paths)
    if config.sample.negative_prompt:
        # Flux2Pipeline has no negative prompt (dev's guidance is distilled); Flux2KleinPipeline's guidance always
        # uses "" (pipeline_flux2_klein.py:749-758).
        p.append(f"sample.negative_prompt: {config.sample.negative_prompt!r} has no effect on FLUX.2 (dev's "
                 "guidance is distilled, klein guides against the empty prompt): unset it")
    return p


def flux2_klein_checks(config, *, check_paths: bool = True) -> list[str]:
    p = flux2_checks(config, check_paths=check_paths)
    if config.flow.guidance != 1.0:
        # Flux2KleinPipeline passes guidance=None (pipeline_flux2_klein.py:854): klein has no guidance embedding.
        p.append(f"flow.guidance: {config.flow.guidance} feeds FLUX.2 [dev]'s guidance embedding, which klein does "
                 "not have (it samples with real guidance, sample.guidance_scale): unset flow.guidance")
    return p
