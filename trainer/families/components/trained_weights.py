"""What every diffusion family does with its trained weights and sample prompts, as functions it calls.

Checkpoint tensors are named `<module>.<parameter>` (`unet.*`, `text_encoder.*`, `text_encoder_2.*`,
`transformer.*`): existing checkpoints and resumes depend on these names.
"""

from __future__ import annotations

from collections import Counter

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from PIL import Image

from trainer.families.protocol import WorkerContext

NamedModules = Sequence[tuple[str, Any]]
"""(checkpoint prefix, module) pairs."""


def unwrapped(ctx: WorkerContext, module: torch.nn.Module) -> torch.nn.Module:
    """The plain model under the parallel wrapper, to sample with or save (under FSDP: the gathered weights)."""
    assert ctx.unwrap is not None, "WorkerContext sets unwrap"
    return ctx.unwrap(module)


def named_trainable(ctx: WorkerContext, modules: NamedModules) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The trained parameters under their checkpoint names, read from the unwrapped modules (under FSDP: the
    gathered full weights)."""
    for prefix, module in modules:
        for name, p in unwrapped(ctx, module).named_parameters():
            if p.requires_grad:
                yield f"{prefix}.{name}", p


def trainable_state(ctx: WorkerContext, modules: NamedModules) -> dict[str, torch.Tensor]:
    """The trained weights for a checkpoint (fp32, CPU)."""
    return {name: p.detach().float().cpu().contiguous() for name, p in named_trainable(ctx, modules)}


def pixel_size(size: int | tuple[int, int] | None, resolution: int) -> tuple[int, int]:
    """(width, height) from a family `sample()`'s `size`: a (width, height) pair, a square side, or None (the
    training resolution)."""
    if isinstance(size, tuple):
        return size
    return (size or resolution, size or resolution)


def load_trainable_state(ctx: WorkerContext, modules: NamedModules, state: dict[str, torch.Tensor]) -> None:
    """Copy a checkpoint's tensors into the trained parameters; every one of them must be there."""
    params = dict(named_trainable(ctx, modules))
    missing = sorted(set(params) - set(state))
    if missing:
        raise RuntimeError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[name].to(p.device, p.dtype))


def sample_shape(sample_cfg, resolution: int, buckets: list[tuple[int, int]] | None = None,
                 item_buckets: list[int] | None = None) -> tuple[int, int]:
    """(width, height) of the samples: `sample.width`/`height`, else `sample.size` (square), else the bucket most
    items train at (a bucketed run is judged at the shape it learns most), else the training resolution."""
    default = (sample_cfg.size, sample_cfg.size) if sample_cfg.size else (resolution, resolution)
    if not sample_cfg.size and buckets and item_buckets:
        counts = Counter(item_buckets)  # one pass: this runs at every sample step, over every item
        default = buckets[max(counts, key=lambda b: (counts[b], -b))]
    return sample_cfg.width or default[0], sample_cfg.height or default[1]


def render_prompt_samples(sample_cfg, sample: Callable[..., list[Image.Image]],
                          shape: tuple[int, int]) -> list[tuple[str, Image.Image]]:
    """The preset's sample prompts (`sample.*`), each with its own fixed seed so steps compare, drawn by the
    family's `sample(prompts, seeds, *, size, steps, guidance_scale, negative_prompt)` at `shape` (sample_shape)."""
    if not sample_cfg.prompts:
        return []
    seeds = [sample_cfg.seed + i for i in range(len(sample_cfg.prompts))]
    images = sample(list(sample_cfg.prompts), seeds, size=shape, steps=sample_cfg.steps,
                    guidance_scale=sample_cfg.guidance_scale, negative_prompt=sample_cfg.negative_prompt)
    return list(zip(sample_cfg.prompts, images))
