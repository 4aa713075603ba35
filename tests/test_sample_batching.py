"""Sample steps draw the images of one prompt in one pipeline call (its text encoded once, one denoiser batch),
each image from its own seed: the images equal one-call-per-image sampling to rounding, and the denoiser runs once
per prompt and step instead of once per image. In process, on every diffusion family's tiny model."""

import numpy as np
import pytest

from tests.test_bucketing_families import make_family, mixed_data  # noqa: F401 (fixture)
from trainer.families.components.trained_weights import PIXELS_PER_SAMPLE_CALL_DECODED_TOGETHER, prompt_runs

PROMPTS, SEEDS = ["a red circle"] * 3 + ["a blue circle"], [5, 6, 7, 8]


def test_runs_group_one_prompts_images_up_to_the_pixel_cap():
    assert prompt_runs(PROMPTS, SEEDS, 64, 64) == [("a red circle", [5, 6, 7]), ("a blue circle", [8])]
    assert prompt_runs(["a", "b", "a"], [1, 2, 3], 64, 64) == [("a", [1]), ("b", [2]), ("a", [3])]  # order kept
    assert prompt_runs(["a"] * 5, list(range(5)), 512, 512) == [("a", [0, 1, 2, 3]), ("a", [4])]
    assert prompt_runs(["a"] * 2, [0, 1], 1024, 1024) == [("a", [0]), ("a", [1])]  # SDXL: one at a time, as before
    assert prompt_runs(["a"] * 2, [0, 1], 512, 512, PIXELS_PER_SAMPLE_CALL_DECODED_TOGETHER) == [("a", [0]), ("a", [1])]


@pytest.fixture(scope="module")
def tiny_models(tiny_sd_path, tiny_sdxl_path, tiny_flux_path, tiny_sd3_path):
    return {"sd": tiny_sd_path, "sdxl": tiny_sdxl_path, "flux": tiny_flux_path, "sd3": tiny_sd3_path}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sd", "sdxl", "flux", "sd3", "flux:uncached", "sd3:uncached"])
def test_one_call_per_prompt_draws_each_seeds_image(tmp_path, tiny_models, mixed_data, name):
    # the prompts are sample prompts, so FLUX and SD3 draw them from their text cache's embeddings; `uncached`:
    # without the cache their pipelines encode the prompt themselves
    name, _, uncached = name.partition(":")
    family, _ = make_family(tmp_path, name, tiny_models[name], mixed_data,
                            "sample.prompts=[a red circle, a blue circle]", "sample.negative_prompt=blurry",
                            *(["data.cache_text_embeddings=false"] if uncached else []))
    if hasattr(family, "flow"):
        cache = family.flow.text_cache
        assert cache is None if uncached else {"a red circle", "a blue circle"} <= set(cache.index)
    denoiser = family.flow.transformer if hasattr(family, "flow") else family.unet
    calls = []
    denoiser.register_forward_pre_hook(lambda *_: calls.append(1))
    kwargs = dict(size=32, steps=2, guidance_scale=2.0, negative_prompt="blurry")

    batched = family.sample(PROMPTS, SEEDS, **kwargs)
    batched_calls, calls[:] = len(calls), []
    alone = [family.sample([prompt], [seed], **kwargs)[0] for prompt, seed in zip(PROMPTS, SEEDS)]

    pixels = [np.asarray(image, dtype=np.int16) for image in batched]
    for image, single in zip(pixels, alone):
        assert np.abs(image - np.asarray(single, dtype=np.int16)).max() <= 1
    assert np.abs(pixels[0] - pixels[1]).max() > 8  # each image has its own seed's noise, not a copy
    assert batched_calls * 2 == len(calls)  # 2 prompts' calls against 4 images' (per step; CFG batches inside)
