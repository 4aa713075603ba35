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

from tests import flow_family_runs as flow_runs
from tests.flow_family_runs import data, runs  # noqa: F401  (fixtures)
from trainer.core.config import load_config
from trainer.errors import ConfigError
from trainer.families.components import flow_matching as fm

PRESET = Path(__file__).resolve().parents[1] / "presets" / "demo-chroma.yaml"


@pytest.fixture(scope="module")
def tiny_chroma(demo_asset):
    return demo_asset("tiny-chroma")  # the demo's model, built once per session


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


def test_gradient_checkpointing_keeps_the_caption_mask_and_trains_what_the_plain_call_trains(tiny_chroma, pipe):
    """A caption shorter than max_sequence_length has padding tokens that the mask hides. diffusers' own
    checkpointing calls Chroma's single blocks without the mask; the family's checkpointing gives the plain call's
    prediction and gradients."""
    import copy

    from diffusers import ChromaTransformer2DModel

    family = _family(pipe, "flow.max_sequence_length=16")
    with torch.no_grad():
        text = family.encode_caption("a red circle")
    assert text["mask"].sum() < text["mask"].numel()  # there is padding to hide
    latents, sigmas = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0.5])

    def step(transformer):
        transformer.zero_grad()
        out = family.forward(transformer, latents, sigmas, text)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}

    plain = ChromaTransformer2DModel.from_pretrained(tiny_chroma, subfolder="transformer")
    ours, diffusers_own = copy.deepcopy(plain), copy.deepcopy(plain)
    ours.enable_gradient_checkpointing(family.checkpointing_func(ours))
    diffusers_own.enable_gradient_checkpointing()
    for model in (plain, ours, diffusers_own):
        model.train()
    want, want_grads = step(plain)
    got, got_grads = step(ours)
    torch.testing.assert_close(got, want)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], msg=name)
    unmasked, _ = step(diffusers_own)  # what the workaround is for (drop it once this matches)
    assert not torch.allclose(unmasked, want)


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

EXTRA = ("flow.max_sequence_length=16",)


@pytest.fixture(scope="module")
def reference(runs, tiny_chroma, data):
    return flow_runs.reference(runs, PRESET, tiny_chroma, data, *EXTRA)


@pytest.mark.slow
def test_the_lora_loads_back_through_the_pipeline(reference, tiny_chroma):
    from diffusers import ChromaPipeline

    flow_runs.assert_lora_loads_back(ChromaPipeline, tiny_chroma, reference)


@pytest.mark.slow
def test_stopped_then_resumed_on_two_processes_matches_one_uninterrupted_process(reference, runs, tiny_chroma, data):
    flow_runs.assert_resumed_on_two_processes_matches(reference, runs, PRESET, tiny_chroma, data, *EXTRA)


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
