"""The demo's pretrained base (trainer/assets/tiny-sd, made by trainer.families.sd.tiny_base) and what the demo
does with it: the base follows prompts and does not know the concept; the demo's LoRA teaches it the concept
without forgetting the control prompt; the shipped files are what their checksums say; the pretraining script
is reproducible from its seed."""

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.engine_helpers import launch, log_of
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.errors import UserError
from trainer.families.components.shape_score import fraction_showing, read_image
from trainer.families.components.shapes import BASE_COLOURS, BASE_SHAPES
from trainer.families.sd import demo, tiny_base

PRESET = demo.SHIPPED_MODEL.parents[2] / "presets"
CONCEPT = "a photo of a sks circle on a white background"


@pytest.fixture(scope="module")
def base_pipeline():
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(demo.shipped_tiny_sd()["tiny-sd"])
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _draw(pipe, prompt, seeds):
    return pipe([prompt] * len(seeds), num_inference_steps=20, guidance_scale=tiny_base.GUIDANCE,
                generator=[torch.Generator().manual_seed(s) for s in seeds]).images


@pytest.mark.slow  # 14 s: every base colour and shape, sampled and judged
def test_the_base_draws_the_shape_and_colour_a_prompt_asks_for(base_pipeline):
    # On a gray background (pretraining.json: 0.94 over all 36 prompts, 4 seeds each). A random model scores
    # about 1/12 here.
    scores = {(colour, shape): fraction_showing(_draw(base_pipeline, f"a photo of a {colour} {shape} on a gray "
                                                      "background", [0, 1]), f"{colour} {shape}")
              for colour in BASE_COLOURS for shape in BASE_SHAPES}
    assert sum(scores.values()) / len(scores) >= 0.8, scores


def test_the_base_does_not_know_the_concept(base_pipeline):
    images = _draw(base_pipeline, CONCEPT, list(range(8)))
    assert fraction_showing(images, "yellow") == 0  # no yellow at all: it never saw the colour, [read_image(im) for im in images]


def test_the_shipped_files_are_checked_against_their_checksums(tmp_path):
    assert demo.shipped_tiny_sd() == {"tiny-sd": demo.SHIPPED_MODEL}
    copy = shutil.copytree(demo.SHIPPED_MODEL, tmp_path / "tiny-sd")
    demo.verify_checksums(copy)
    weights = copy / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(UserError, match="damaged.*unet/diffusion_pytorch_model.safetensors.*Reinstall"):
        demo.verify_checksums(copy)


def test_the_concept_dataset_is_yellow_circles_captioned_with_the_identifier(tmp_path):
    from PIL import Image

    folder = demo.make_concept_dataset(tmp_path / "c", count=6)
    images = sorted(folder.glob("*.png"))
    assert len(images) == 6
    assert all(read_image(Image.open(p)).shows("yellow circle") for p in images)
    assert {p.with_suffix(".txt").read_text().strip() for p in images} == {
        f"a photo of a sks circle on a {bg} background" for bg in ("white", "gray", "black")}


@pytest.mark.slow
def test_pretraining_is_reproducible_from_its_seed(tmp_path):
    kwargs = dict(seed=3, vae_steps=2, denoiser_steps=2, images=48, measure_seeds=1, measure_steps=2, log=lambda m: None)
    report = tiny_base.pretrain(tmp_path / "a", **kwargs)
    tiny_base.pretrain(tmp_path / "b", **kwargs)
    for part in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                 "text_encoder/model.safetensors"):
        a, b = load_file(tmp_path / "a" / part), load_file(tmp_path / "b" / part)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), part
    assert 0 <= report["prompt_following"] <= 1 and len(report["per_prompt"]) == len(BASE_COLOURS) * len(BASE_SHAPES) * 3
    demo.verify_checksums(tmp_path / "a")


@pytest.mark.slow
def test_the_demo_lora_teaches_the_concept_and_keeps_the_control(tmp_path):
    # The demo preset (fixed seed), shortened to 100 steps with samples at the start and the end only: the
    # concept prompt draws no yellow circle at step 0 and does at the end, while the control prompt draws its
    # blue square at both (the preset itself: 0 -> 1.0 by step 100 of 300).
    config = load_config(PRESET / "demo.yaml", ["devices=cpu:1", "checkpoint.every=0", "train.steps=100",
                                                 "train.warmup_steps=10", "sample.every=100"])
    run_dir, final = launch(tmp_path, config)
    assert final["type"] == "done", log_of(run_dir)
    scores = {e["step"]: e for e in read_events(run_dir) if e["type"] == "eval"}
    assert sorted(scores) == [0, 100]
    assert scores[0]["concept"] <= 0.2 and scores[0]["control"] >= 0.75, scores
    assert scores[100]["concept"] >= 0.75 and scores[100]["control"] >= 0.75, scores
    samples = [e for e in read_events(run_dir) if e["type"] == "sample" and e["step"] == 0]
    assert [e["prompt"] for e in samples] == [config.sample.concept.prompt, config.sample.control.prompt]
    from PIL import Image

    strip = Image.open(run_dir / samples[0]["path"])
    assert strip.size == (4 * 64 + 3 * 2, 64)  # four seeds side by side
