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


# One pipeline call draws the images of one prompt: its text is encoded once and the denoiser runs one batch (the
# demo's sample steps took 40% less CPU than one call per image: bench/README.md, vs_diffusers.py). Each image keeps
# its own seeded generator, so its starting noise is its seed's and its pixels equal a one-image call's to float
# rounding. Capped in pixels, so that a sample step never needs much more memory than it did one image at a time:
# the UNet families decode each image alone (a VAE decode at 512 px is the largest activation of sampling) and
# batch up to 4 images of 512 px; FLUX's and SD3's pipelines decode the whole batch, so they batch only up to
# 256 px (the demos) and draw larger images one by one, as before.
PIXELS_PER_SAMPLE_CALL = 4 * 512 * 512
PIXELS_PER_SAMPLE_CALL_DECODED_TOGETHER = 4 * 256 * 256


def prompt_runs(prompts: list[str], seeds: list[int], width: int, height: int,
                pixels: int = PIXELS_PER_SAMPLE_CALL) -> list[tuple[str, list[int]]]:
    """Consecutive images of the same prompt, grouped into (prompt, seeds) calls of at most `pixels` pixels (at
    least one image each)."""
    limit = max(1, pixels // (width * height))
    runs: list[tuple[str, list[int]]] = []
    for prompt, seed in zip(prompts, seeds):
        if runs and runs[-1][0] == prompt and len(runs[-1][1]) < limit:
            runs[-1][1].append(seed)
        else:
            runs.append((prompt, [seed]))
    return runs


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


def sample_prompts(sample_cfg) -> list[str]:
    """`sample.prompts`, then the scored prompts (`sample.concept`, `sample.control`) not already among them."""
    prompts = list(sample_cfg.prompts)
    for scored in (sample_cfg.concept, sample_cfg.control):
        if scored.prompt and scored.prompt not in prompts:
            prompts.append(scored.prompt)
    return prompts


def render_prompt_samples(sample_cfg, sample: Callable[..., list[Image.Image]],
                          shape: tuple[int, int]) -> list[tuple[str, list[Image.Image]]]:
    """Every sample prompt (`sample_prompts`) with its `sample.images_per_prompt` images, each from its own fixed
    seed so that steps compare, drawn by the family's `sample(prompts, seeds, *, size, steps, guidance_scale,
    negative_prompt)` at `shape` (sample_shape)."""
    prompts, n = sample_prompts(sample_cfg), max(1, sample_cfg.images_per_prompt)
    if not prompts:
        return []
    repeated = [prompt for prompt in prompts for _ in range(n)]
    seeds = [sample_cfg.seed + i * n + j for i in range(len(prompts)) for j in range(n)]
    images = sample(repeated, seeds, size=shape, steps=sample_cfg.steps, guidance_scale=sample_cfg.guidance_scale,
                    negative_prompt=sample_cfg.negative_prompt)
    return [(prompt, images[i * n:(i + 1) * n]) for i, prompt in enumerate(prompts)]
