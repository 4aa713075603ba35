"""The plan's cache figures: what the text-embedding and latent caches (trainer.families.components.text_cache and
latent_cache) will write to disk for this dataset, before anything is encoded. Pure and torch-free: the scan's
images, captions and buckets, and the family's cached layout (trainer.core.memory.ModelSizes).

Exact for what they count (the tensors' bytes in the cache files; each file's small safetensors header aside):
- text: one row per distinct caption (the captions as the text cache keys them: prefix, the empty caption when
  captions are dropped, the sample prompts and the negative prompt) of `tokens x floats per token + floats per
  caption` float32 values (the flow-matching families cache their encoders' outputs in fp32);
- latents: per image, the VAE's mean and std at its bucket's size / the VAE's factor, twice with flips, once more
  for a control image, in the VAE's dtype (bf16 on a bf16 GPU, fp32 on the CPU and under fp16 or fp32).
Neither is held in RAM: training reads one row at a time from disk (trainer.families.components.disk_rows), so
memory holds the micro-batch's rows, and the files sit in the OS page cache (shared by the node's processes).
"""

from __future__ import annotations

from collections import Counter

from trainer.core.memory import ModelSizes

FP32 = 4


def cached_captions(config, sizes: ModelSizes, items) -> list[str]:
    """The distinct texts a flow-matching family's text cache holds for these images (as
    CaptionedLatents.captions and FlowTransformerTrainer._cache_text gather them, with the family's texts_for)."""
    from trainer.core.data.sources import sources

    folders = sources(config.data)
    texts: list[str] = []
    for index, source in enumerate(folders):
        mine = [item for item in items if item.dataset == index]
        if sizes.text_per_image:  # an entry per (caption, control image): the same caption twice is two entries
            texts += [f"{text}\0{item.path}" for item in mine
                      for text in source.augment.cached_captions([item.caption])]
        else:
            texts += source.augment.cached_captions(item.caption for item in mine)
    sample = config.sample  # sample.prompts, then the scored prompts (trained_weights.sample_prompts)
    prompts = list(sample.prompts)
    prompts += [s.prompt for s in (sample.concept, sample.control) if s.prompt and s.prompt not in prompts]
    texts += prompts
    if prompts and sizes.negative_text is not None:
        texts.append(sample.negative_prompt if sizes.takes_negative and sample.negative_prompt else sizes.negative_text)
    return sorted(set(texts))


def text_cache_bytes(sizes: ModelSizes, captions: int, tokens: int) -> int:
    per_token, per_caption = sizes.text_floats
    return captions * (tokens * per_token + per_caption) * FP32


def latent_bytes(sizes: ModelSizes, shapes: dict[tuple[int, int], int], dtype_bytes: int, columns: int) -> int:
    """`shapes`: {(width, height): images}; `columns`: latent tensors per image (mean, std, flips, controls)."""
    f, c = sizes.latent_factor, sizes.latent_channels
    return sum(n * columns * c * (h // f) * (w // f) * dtype_bytes for (w, h), n in shapes.items())


def cache_line(config, sizes: ModelSizes, scan, precision: str, text_cached: bool) -> str:
    """E.g. `text cache: 1,200 captions x (512 tokens x 4,096 + 768) x fp32 = 9.4 GiB on disk; latent cache: ...`;
    empty for a family without a cache layout. `scan`: the launcher's (its training items and held-out ones)."""
    if not sizes.text_tokens:
        return ""
    items, held_out = list(getattr(scan, "items", None) or ()), list(getattr(scan, "held_out", None) or ())
    parts = []
    if text_cached:
        captions = len(cached_captions(config, sizes, items + held_out))
        tokens = config.flow.max_sequence_length or sizes.text_tokens
        per_token, per_caption = sizes.text_floats
        extra = f" + {per_caption:,}" if per_caption else ""
        what = "(caption, control image) pairs" if sizes.text_per_image else "captions"
        parts.append(f"text cache: {captions:,} {what} x ({tokens} tokens x {per_token:,}{extra}) x fp32 = "
                     f"{_gb(text_cache_bytes(sizes, captions, tokens))} on disk")
    if config.data.cache_latents and config.data.center_crop and items:
        # the VAE runs in bf16 under bf16, else in fp32 (FLUX/SD3 in fp16 give NaN: trainer.families.flow.trainer)
        dtype_bytes, dtype = (2, "bf16") if precision == "bf16" else (4, "fp32")
        flips = config.data.flip or any(bool(d.flip) for d in config.data.datasets or ())
        controls = 2 if config.data.control_path else 1
        size = latent_bytes(sizes, _shapes(config, items), dtype_bytes, 2 * (2 if flips else 1) * controls)
        size += latent_bytes(sizes, _shapes(config, held_out), dtype_bytes, 2 * controls)  # unflipped
        what = "mean, std" + (", flipped" if flips else "") + (", control images" if controls > 1 else "")
        shown = " + ".join(f"{n:,} at {w}x{h}" for (w, h), n in _shapes(config, items + held_out).items())
        parts.append(f"latent cache: {shown} x ({what}) x {sizes.latent_channels} channels at "
                     f"1/{sizes.latent_factor} x {dtype} = {_gb(size)} on disk")
    if not parts:
        return ""
    return "; ".join(parts) + " (read a row at a time: not held in RAM; the OS page cache keeps what fits)"


def _shapes(config, items) -> dict[tuple[int, int], int]:
    """{(width, height): images} as the latent cache groups them (trainer.core.data.sources.image_targets)."""
    from trainer.core.data.sources import image_targets

    if not items:
        return {}
    if config.data.bucketing or config.data.datasets:
        return dict(Counter(image_targets(items, config.data, True)))
    return {(config.data.resolution, config.data.resolution): len(items)}


def _gb(size: int) -> str:
    if size >= 2**30:
        return f"{size / 2**30:,.1f} GiB ({size:,} bytes)"
    return f"{size / 2**20:,.1f} MiB ({size:,} bytes)"
