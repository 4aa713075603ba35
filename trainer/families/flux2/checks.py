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
