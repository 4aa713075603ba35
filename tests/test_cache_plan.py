"""The plan's cache figures (trainer.core.cache_plan): what the text and latent caches will write, counted before
anything is encoded, equal to the tensors' bytes the caches a tiny run writes hold (its files' safetensors
headers aside). In process on the tiny FLUX.1 (its own widths in the layout: the plan's figures for a real model
use the family's published ones)."""

from dataclasses import replace

import pytest
from safetensors import safe_open

from tests.test_bucketing_families import make_family, mixed_data, models  # noqa: F401 (fixtures)
from trainer.core.cache_plan import cache_line, cached_captions, latent_bytes, text_cache_bytes
from trainer.core.family_spec import check_captioned_images
from trainer.families import spec_of


def _tensor_bytes(files) -> int:
    total = 0
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
    return total


@pytest.mark.slow  # one tiny FLUX family loaded and its caches built
def test_the_plans_cache_figures_are_the_bytes_a_tiny_run_writes(tmp_path, models, mixed_data):
    family, _ = make_family(tmp_path, "flux", models["flux"], mixed_data, "data.flip=true", "data.caption_dropout=0.1",
                            "sample.prompts=[a photo of sks dog]")
    config, flow = family.cfg, family.flow
    clip, t5 = flow.text_encoders
    vae = flow.vae.config
    sizes = replace(spec_of("flux").sizes, text_floats=(t5.config.d_model, clip.config.hidden_size),
                    latent_channels=vae.latent_channels, latent_factor=2 ** (len(vae.block_out_channels) - 1))
    scan = check_captioned_images(config)
    captions = cached_captions(config, sizes, scan.items)
    assert captions == sorted(set(flow.data.captions() + ["a photo of sks dog"]))  # "" among them (dropout)

    cache = tmp_path / "cache"
    text_files = sorted((cache / "text").rglob("chunk-*.safetensors"))
    latent_files = sorted(f for f in cache.rglob("chunk-*.safetensors") if "text" not in f.relative_to(cache).parts)
    assert text_files and latent_files
    text = text_cache_bytes(sizes, len(captions), config.flow.max_sequence_length)
    assert text == _tensor_bytes(text_files)
    line = cache_line(config, sizes, scan, "fp32", True)
    latents = _tensor_bytes(latent_files)
    assert f"({text:,} bytes)" in line and f"({latents:,} bytes)" in line, line
    assert "flipped" in line and "fp32" in line
    # the latent figure is its formula's: images x (mean, std and their flips) x channels x (h/f x w/f) x 4 bytes
    assert latents == latent_bytes(sizes, _shapes_of(config, scan.items), 4, 4)


def _shapes_of(config, items):
    from collections import Counter

    from trainer.core.data.sources import image_targets

    return dict(Counter(image_targets(items, config.data, True)))


def test_a_bf16_gpu_plans_half_the_latent_bytes_and_the_family_layout_sets_the_text_bytes():
    flux, flux2 = spec_of("flux").sizes, spec_of("flux2").sizes
    # FLUX.1: 1,200 captions x (512 x 4096 + 768) fp32 values
    assert text_cache_bytes(flux, 1200, 512) == 1200 * (512 * 4096 + 768) * 4
    assert text_cache_bytes(flux2, 10, 512) == 10 * 512 * 15360 * 4  # Mistral's 3 stacked layers
    shapes = {(1024, 1024): 3, (832, 1216): 2}
    assert latent_bytes(flux, shapes, 2, 2) == (3 * 128 * 128 + 2 * 104 * 152) * 16 * 2 * 2
    assert latent_bytes(flux2, shapes, 2, 2) == 2 * latent_bytes(flux, shapes, 2, 2)  # 32 channels


def test_the_plan_of_a_shipped_gpu_preset_says_its_caches_figures(mixed_data, monkeypatch):
    """What `--dry-run` prints as `caches:` (trainer.cli.follow.print_plan), for Qwen-Image's 16 GB preset on a local folder:
    its 512-token Qwen2.5-VL rows, the negative prompt its true CFG encodes, bf16 latents on the card it names."""
    from pathlib import Path

    from trainer.core.config import load_config
    from trainer.core.hardware import CPU_ONLY
    from trainer.core.plan import make_plan

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # a plan reads no model file (test_shipped_presets)
    preset = Path(__file__).resolve().parents[1] / "presets" / "qwenimage-lora-16gb.yaml"
    config = load_config(preset, [f"data.path={mixed_data}"])
    scan = check_captioned_images(config)
    plan = make_plan(config, CPU_ONLY).with_buckets(config, scan).with_held_out(scan).with_caches(config, scan)
    sizes = spec_of("qwenimage").sizes
    captions = cached_captions(config, sizes, scan.items)
    assert config.sample.negative_prompt in captions and len(captions) == len(set(captions))
    assert plan.caches.startswith(f"text cache: {len(captions)} captions x (512 tokens x 3,585) x fp32 = ")
    assert f"({text_cache_bytes(sizes, len(captions), 512):,} bytes) on disk; latent cache: " in plan.caches
    assert " x bf16 = " in plan.caches and "not held in RAM" in plan.caches


def test_an_edit_familys_text_cache_counts_a_row_per_caption_and_control_image(mixed_data, tmp_path, monkeypatch):
    """Qwen-Image-Edit's text embedding reads the control image with the caption (trainer.families.qwenimage_edit
    text_key): images that share a caption are still a row each, where Qwen-Image caches that caption once."""
    import shutil
    from pathlib import Path

    from trainer.core.config import load_config

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    controls = tmp_path / "controls"
    controls.mkdir()
    for image in mixed_data.glob("*.png"):
        shutil.copy(image, controls / image.name)
    preset = Path(__file__).resolve().parents[1] / "presets" / "qwenimage-edit-lora-24gb.yaml"
    config = load_config(preset, [f"data.path={mixed_data}", f"data.control_path={controls}"])
    scan = check_captioned_images(config)
    captions = {item.caption for item in scan.items}
    assert len(captions) < len(scan.items)  # two colours, more images
    edit, plain = spec_of("qwenimage_edit").sizes, spec_of("qwenimage").sizes
    prompts = len(cached_captions(config, plain, [])) if config.sample.prompts else 0
    assert len(cached_captions(config, edit, scan.items)) == len(scan.items) + prompts
    assert len(cached_captions(config, plain, scan.items)) == len(captions) + prompts
    assert cache_line(config, edit, scan, "bf16", True).startswith(
        f"text cache: {len(scan.items) + prompts} (caption, control image) pairs x (512 tokens x 3,585) x fp32")
