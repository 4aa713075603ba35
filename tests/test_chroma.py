"""Chroma on its tiny offline model (the real ChromaTransformer2DModel / ChromaPipeline classes, random weights):

- the training call is the pipeline's own: the caption's T5 embedding and mask, the mask extended over the image
  tokens, packed latents, the timestep as sigma, the scheduler's shift; and the velocity target is what the
  pipeline's scheduler steps along;
- through the real launcher: 1 process and 2 processes give the same weights, a stopped-then-resumed run the
  weights of an uninterrupted one, and the LoRA file loads back through ChromaPipeline.load_lora_weights with
  exactly the trained weights;
- the kohya/ComfyUI file names only modules of ComfyUI's Chroma model, with the fused widths they have there.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.engine_helpers import assert_lora_loaded, assert_same_weights, final_weights, launch, log_of, progress
from trainer.core.config import load_config
from trainer.errors import ConfigError
from trainer.core.hardware import CPU_ONLY
from trainer.core.resume import resume_run
from trainer.families.components import flow_matching as fm

PRESET = Path(__file__).resolve().parents[1] / "presets" / "demo-chroma.yaml"


@pytest.fixture(scope="module")
def tiny_chroma(tmp_path_factory):
    from trainer.families.chroma.demo import make_tiny_chroma

    return make_tiny_chroma(tmp_path_factory.mktemp("chroma") / "tiny-chroma")


@pytest.fixture(scope="module")
def pipe(tiny_chroma):
    from diffusers import ChromaPipeline

    return ChromaPipeline.from_pretrained(tiny_chroma)


def _family(pipe, *overrides):
    """The Chroma family's hooks on a loaded pipeline, without load() (what the trainer would set)."""
    from trainer.families.chroma.family import ChromaFamily

    config = load_config(None, ["model.family=chroma", *overrides], check_paths=False)
    family = ChromaFamily(SimpleNamespace(config=config, device=torch.device("cpu")))
    family.flow.pipe, family.flow.transformer = pipe, pipe.transformer
    family.flow.scheduler_config = dict(pipe.scheduler.config)
    return family


def test_the_training_call_is_the_pipelines_call(pipe):
    family = _family(pipe, "flow.max_sequence_length=16")
    caption = "a photo of a red circle"
    text = family.encode_caption(caption)
    embeds, text_ids, mask, *_ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, max_sequence_length=16)
    torch.testing.assert_close(text["embeds"], embeds)
    assert mask.sum().item() == (pipe.tokenizer(caption).attention_mask.count(1) + 1)  # + the first padding token

    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 16, 16, generator=gen)  # (B, C, H, W) as the VAE gives them
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = family.forward(pipe.transformer, latents, sigmas, {k: torch.cat([v, v]) for k, v in text.items()})
        # ChromaPipeline.__call__, lines 775-866: packed latents, image ids, the mask over text + image tokens
        packed = pipe._pack_latents(latents, 2, 16, 16, 16)
        image_ids = pipe._prepare_latent_image_ids(2, 8, 8, latents.device, latents.dtype)
        attention = pipe._prepare_attention_mask(2, packed.shape[1], latents.dtype, mask.repeat(2, 1))
        theirs = pipe.transformer(hidden_states=packed, timestep=(sigmas * 1000) / 1000,
                                  encoder_hidden_states=embeds.repeat(2, 1, 1), txt_ids=text_ids, img_ids=image_ids,
                                  attention_mask=attention, return_dict=False)[0]
    pixels = 16 * pipe.vae_scale_factor
    torch.testing.assert_close(ours, pipe._unpack_latents(theirs, pixels, pixels, pipe.vae_scale_factor))


def test_the_shift_is_the_schedulers_and_the_target_is_its_velocity(pipe):
    from diffusers.pipelines.chroma.pipeline_chroma import calculate_shift

    family = _family(pipe)
    s = pipe.scheduler.config
    mu = calculate_shift(32 * 32, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    assert family.shift((16, 64, 64)) == pytest.approx(math.exp(mu))  # 512 px: 32 x 32 packed tokens
    assert _family(pipe, "flow.shift=2.0").shift((16, 64, 64)) == 2.0

    # The scheduler's Euler step along the velocity the loss regresses (noise - x0) lands on the interpolation at
    # the next sigma: the target is what sampling integrates.
    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[0.9, 0.6, 0.3], mu=mu)
    sigma, after = scheduler.sigmas[0], scheduler.sigmas[1]
    noisy, target = fm.noisy_and_target(x0, noise, sigma.reshape(1))
    stepped = scheduler.step(target, scheduler.timesteps[0], noisy).prev_sample
    torch.testing.assert_close(stepped, (1 - after) * x0 + after * noise, rtol=1e-4, atol=1e-5)


def test_flux_dev_guidance_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="flow.guidance: 3.5 feeds FLUX.1-dev's guidance embedding"):
        load_config(PRESET, ["flow.guidance=3.5"], check_paths=False)


# ---- through the real launcher ----------------------------------------------------------------------------------

RUN = ["precision=fp32", "batch.total=2", "train.steps=4", "train.lr=1e-3", "train.warmup_steps=0",
       "sample.every=0", "checkpoint.every=0", "flow.max_sequence_length=16"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from trainer.families.sd.demo import make_demo_dataset

    return make_demo_dataset(tmp_path_factory.mktemp("chroma-data") / "data", count=4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("chroma-runs")


def _config(tiny_chroma, data, *overrides):
    return load_config(PRESET, [f"model.path={tiny_chroma}", f"data.path={data}", *RUN, *overrides])


@pytest.fixture(scope="module")
def reference(runs, tiny_chroma, data):
    run_dir, final = launch(runs, _config(tiny_chroma, data, "devices=cpu:1", "batch.per_device=2", "name=ref"))
    assert final["type"] == "done", log_of(run_dir)
    return run_dir


@pytest.mark.slow
def test_two_processes_match_one_and_the_lora_loads_back(reference, runs, tiny_chroma, data, pipe):
    run_dir, final = launch(runs, _config(tiny_chroma, data, "devices=cpu:2", "batch.per_device=1", "name=ddp"))
    assert final["type"] == "done", log_of(run_dir)
    assert_same_weights(final_weights(reference), final_weights(run_dir))
    assert [e["loss"] for e in progress(reference)] == pytest.approx([e["loss"] for e in progress(run_dir)], rel=1e-5)

    from diffusers import ChromaPipeline

    loaded = ChromaPipeline.from_pretrained(tiny_chroma)
    loaded.load_lora_weights(reference / "output")
    assert_lora_loaded(loaded, final_weights(reference))


@pytest.mark.slow
def test_stopped_then_resumed_matches_the_uninterrupted_run(reference, runs, tiny_chroma, data):
    config = _config(tiny_chroma, data, "devices=cpu:1", "batch.per_device=2", "name=stopped")
    run_dir, final = launch(runs, config, fault="stop_at_step=2")
    assert final["type"] == "stopped", log_of(run_dir)
    final = resume_run(run_dir, [], hw=CPU_ONLY).wait(timeout=300)
    assert final["type"] == "done", log_of(run_dir)
    assert [e["step"] for e in progress(run_dir)] == [1, 2, 3, 4]
    assert_same_weights(final_weights(reference), final_weights(run_dir))


@pytest.mark.slow
def test_every_key_of_the_comfyui_file_names_a_module_of_comfyuis_chroma(reference, pipe):
    """ComfyUI's Chroma is its Flux model (comfy/model_base.py `class Chroma(Flux)`) over comfy.ldm.chroma's
    blocks, whose Linear layers carry BFL's names; comfy/lora.py's model_lora_keys_unet maps `lora_unet_<path>`
    (dots as underscores) onto each `diffusion_model.<path>.weight`. Restated here: those paths and their
    out-widths, from the model's config (ComfyUI is not installed)."""
    config = pipe.transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    mlp = 4 * hidden  # mlp_ratio 4
    widths = {}
    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            widths.update({f"double_blocks_{i}_{stream}_attn_qkv": 3 * hidden, f"double_blocks_{i}_{stream}_attn_proj": hidden,
                           f"double_blocks_{i}_{stream}_mlp_0": mlp, f"double_blocks_{i}_{stream}_mlp_2": hidden})
    for i in range(config.num_single_layers):
        widths.update({f"single_blocks_{i}_linear1": 3 * hidden + mlp, f"single_blocks_{i}_linear2": hidden})
    kohya = load_file(str(reference / "output" / "ref_kohya.safetensors"))
    modules = {key.split(".")[0] for key in kohya}
    assert modules == {f"lora_unet_{name}" for name in widths}  # every adapted layer, each one ComfyUI knows
    for module in modules:
        assert kohya[f"{module}.lora_up.weight"].shape[0] == widths[module.removeprefix("lora_unet_")]
        assert kohya[f"{module}.alpha"].numel() == 1
