"""Qwen-Image on its tiny offline model (the real QwenImageTransformer2DModel / AutoencoderKLQwenImage /
Qwen2.5-VL / QwenImagePipeline classes, random weights):

- the training call is the pipeline's own: the chat-template embedding without its first 34 tokens, padded in the
  cache and trimmed back (or masked) in the call, packed latents, img_shapes, the timestep as sigma, the
  scheduler's shift; the velocity target is what the pipeline's scheduler steps along; latents are the video VAE's
  single frame normalised per channel, the inverse of what the pipeline decodes;
- through the real launcher: 1 process and 2 processes give the same weights, a stopped-then-resumed run the
  weights of an uninterrupted one, and the LoRA file loads back through QwenImagePipeline.load_lora_weights with
  exactly the trained weights;
- the kohya/ComfyUI file names only modules of ComfyUI's Qwen-Image model, with their widths and the alphas.
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
from tests.flow_family_runs import flow_config
from tests.engine_helpers import launch, log_of
from trainer.core.config import load_config
from trainer.errors import ConfigError
from trainer.families.components import flow_matching as fm

PRESET = Path(__file__).resolve().parents[1] / "presets" / "demo-qwenimage.yaml"


@pytest.fixture(scope="module")
def tiny_qwen(demo_asset):
    return demo_asset("tiny-qwenimage")  # the demo's model, built once per session


@pytest.fixture(scope="module")
def pipe(tiny_qwen):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(tiny_qwen)


def _family(pipe, *overrides):
    """The Qwen-Image family's hooks on a loaded pipeline, without load() (what the trainer would set)."""
    from trainer.families.qwenimage.family import QwenImageFamily

    config = load_config(None, ["model.family=qwenimage", *overrides], check_paths=False)
    family = QwenImageFamily(SimpleNamespace(config=config, device=torch.device("cpu")))
    family.flow.pipe, family.flow.transformer, family.flow.vae = pipe, pipe.transformer, pipe.vae
    family.flow.scheduler_config = dict(pipe.scheduler.config)
    return family


def test_the_training_call_is_the_pipelines_call(pipe):
    family = _family(pipe, "flow.max_sequence_length=64")
    short, long = "a red circle", "a photo of a red circle on a white background"
    texts = [family.encode_caption(c) for c in (short, long)]
    assert all(t["embeds"].shape[1] == 64 for t in texts)  # one length: captions stack in the cache
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 8, generator=gen)  # (B, C, h, w): the frame dimension is the VAE's own
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = family.forward(pipe.transformer, latents, sigmas, {k: torch.cat([a[k], b[k]]) for k, (a, b) in
                                                                 zip(texts[0], [texts] * 2)})
        # QwenImagePipeline.__call__: one batch of both prompts (padded to the longer, with the mask), packed
        # latents, img_shapes per image, timestep / 1000 of the scheduler's sigma * 1000
        embeds, mask = pipe.encode_prompt([short, long], max_sequence_length=64)
        assert mask is not None and mask[0].sum() < mask[1].sum()  # the short one is padded: the mask matters
        for i in range(2):
            n = int(texts[i]["mask"].sum())
            torch.testing.assert_close(texts[i]["embeds"][0, :n], embeds[i, :n])
        packed = pipe._pack_latents(latents, 2, 16, 8, 8)
        theirs = pipe.transformer(hidden_states=packed, timestep=(sigmas * 1000) / 1000, encoder_hidden_states=embeds,
                                  encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]
        theirs = pipe._unpack_latents(theirs, 64, 64, pipe.vae_scale_factor)[:, :, 0]
        # and one caption alone, as the pipeline samples it: no padding, no mask
        alone, none = pipe.encode_prompt(long, max_sequence_length=64)
        assert none is None
        single = pipe.transformer(hidden_states=packed[1:], timestep=sigmas[1:], encoder_hidden_states=alone,
                                  img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours[1:], pipe._unpack_latents(single, 64, 64, 8)[:, :, 0], rtol=1e-4, atol=1e-5)


def test_latents_are_the_frame_the_pipeline_decodes(pipe):
    family = _family(pipe)
    vae = family.image_vae(pipe.vae)
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        dist = vae.encode(pixels).latent_dist
        direct = pipe.vae.encode(pixels[:, :, None]).latent_dist
    assert dist.mean.shape == (1, 16, 8, 8)
    torch.testing.assert_close(dist.mean, direct.mean[:, :, 0])
    z = family.normalize_latents(dist.mean)
    # The pipeline's decode (lines 705-713) undoes it exactly: latents / (1 / std) + mean
    c = pipe.vae.config
    back = z[:, :, None] / (1.0 / torch.tensor(c.latents_std).view(1, 16, 1, 1, 1)) + torch.tensor(
        c.latents_mean).view(1, 16, 1, 1, 1)
    torch.testing.assert_close(back[:, :, 0], dist.mean, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(z, dist.mean)  # the statistics are applied, not FLUX's absent scaling factor


def test_the_shift_is_the_schedulers_and_the_target_is_its_velocity(pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    family = _family(pipe)
    s = pipe.scheduler.config
    assert (s.max_shift, s.max_image_seq_len) == (0.9, 8192)  # Qwen-Image's, not FLUX's 1.15 at 4096
    mu = calculate_shift(64 * 64, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    assert family.shift((16, 128, 128)) == pytest.approx(math.exp(mu))  # 1024 px: 64 x 64 packed tokens
    assert _family(pipe, "flow.shift=2.0").shift((16, 128, 128)) == 2.0

    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[0.9, 0.6, 0.3], mu=mu)
    sigma, after = scheduler.sigmas[0], scheduler.sigmas[1]
    noisy, target = fm.noisy_and_target(x0, noise, sigma.reshape(1))
    stepped = scheduler.step(target, scheduler.timesteps[0], noisy).prev_sample
    torch.testing.assert_close(stepped, (1 - after) * x0 + after * noise, rtol=1e-4, atol=1e-5)


def test_lora_goes_on_every_layer_that_reaches_the_prediction_and_no_other(pipe, tiny_qwen):
    """The last block's text stream is never read: LoRA there would get no gradient (DDP refuses it). Every kept
    layer's LoRA gets one, every dropped layer's gets none or zeros."""
    from diffusers import QwenImageTransformer2DModel
    from peft import LoraConfig

    from trainer.families.qwenimage.family import BLOCK_TARGETS

    family = _family(pipe)
    transformer = QwenImageTransformer2DModel.from_pretrained(tiny_qwen / "transformer")
    family.flow.transformer = transformer
    kept = family.flow.lora_target_paths()
    every = [f"transformer_blocks.{i}.{t}" for i in range(2) for t in BLOCK_TARGETS]
    text_only = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    assert sorted(set(every) - set(kept)) == [f"transformer_blocks.1.{t}" for t in text_only]
    torch.manual_seed(0)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=every, init_lora_weights=False))  # B != 0
    out = family.forward(transformer, torch.randn(1, 16, 8, 8), torch.tensor([0.5]), family.encode_caption("a cat"))
    out.square().sum().backward()
    grads = {n.split(".lora_")[0]: p.grad for n, p in transformer.named_parameters() if "lora_A" in n}
    assert all(grads[p] is not None and grads[p].abs().sum() > 0 for p in kept)
    assert all(grads[p] is None or grads[p].abs().sum() == 0 for p in set(every) - set(kept))


def test_sampling_uses_true_cfg_with_a_negative_prompt(pipe):
    family = _family(pipe)
    assert family.guidance_kwargs(4.0) == {"true_cfg_scale": 4.0}
    assert family.texts_for("a cat", "") == ["a cat", " "]  # without a negative prompt the pipeline guides nothing


def test_flux_keys_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="flow.guidance: 3.5 feeds FLUX.1-dev's guidance embedding"):
        load_config(PRESET, ["flow.guidance=3.5"], check_paths=False)
    with pytest.raises(ConfigError, match="flow.lora_blocks: 'single'"):
        load_config(PRESET, ["flow.lora_blocks=single"], check_paths=False)


# ---- through the real launcher ----------------------------------------------------------------------------------

EXTRA = ("lora.alpha=2",)  # alpha != rank: the ComfyUI file must carry it


def _config(tiny_qwen, data, *overrides):
    return flow_config(PRESET, tiny_qwen, data, *EXTRA, *overrides)


@pytest.fixture(scope="module")
def reference(runs, tiny_qwen, data):
    return flow_runs.reference(runs, PRESET, tiny_qwen, data, *EXTRA)


@pytest.mark.slow
def test_the_lora_loads_back_through_the_pipeline(reference, tiny_qwen):
    from diffusers import QwenImagePipeline

    flow_runs.assert_lora_loads_back(QwenImagePipeline, tiny_qwen, reference)


@pytest.mark.slow
def test_stopped_then_resumed_on_two_processes_matches_one_uninterrupted_process(reference, runs, tiny_qwen, data):
    flow_runs.assert_resumed_on_two_processes_matches(reference, runs, PRESET, tiny_qwen, data, *EXTRA)


@pytest.mark.slow
def test_every_key_of_the_comfyui_file_names_a_module_of_comfyuis_qwen_image(reference, pipe):
    """ComfyUI's QwenImage (comfy/model_base.py) runs comfy.ldm.qwen_image.model.QwenImageTransformer2DModel,
    whose Linear layers carry diffusers' names (transformer_blocks.N.attn.to_q ... to_out.0, add_*_proj,
    to_add_out; img_mlp/txt_mlp .net.0.proj and .net.2); comfy/lora.py's model_lora_keys_unet maps
    `lora_unet_<path>` (dots as underscores) onto each `diffusion_model.<path>.weight` and reads `<name>.alpha`.
    Restated here: those paths and their out-widths, from the model's config (ComfyUI is not installed)."""
    config = pipe.transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    widths = {}
    for i in range(config.num_layers):
        text = i < config.num_layers - 1  # the last block's text stream is never read: no LoRA there
        names = ("to_q", "to_k", "to_v", "to_out_0", "add_k_proj", "add_v_proj") + text * ("add_q_proj", "to_add_out")
        for name in names:
            widths[f"transformer_blocks_{i}_attn_{name}"] = hidden
        for stream in ("img", "txt") if text else ("img",):
            widths[f"transformer_blocks_{i}_{stream}_mlp_net_0_proj"] = 4 * hidden  # FeedForward, mult 4
            widths[f"transformer_blocks_{i}_{stream}_mlp_net_2"] = hidden
    kohya = load_file(str(reference / "output" / "ref_kohya.safetensors"))
    modules = {key.split(".")[0] for key in kohya}
    assert modules == {f"lora_unet_{name}" for name in widths}  # every adapted layer, each one ComfyUI knows
    diffusers = load_file(str(reference / "output" / "pytorch_lora_weights.safetensors"))
    for module in modules:
        assert kohya[f"{module}.lora_up.weight"].shape[0] == widths[module.removeprefix("lora_unet_")]
        assert kohya[f"{module}.alpha"].item() == 2.0
    # the same trained tensors as the diffusers file (compared by value: underscores do not map back to dots)
    assert sorted(t.sum().item() for k, t in kohya.items() if k.endswith("lora_up.weight")) == pytest.approx(
        sorted(t.sum().item() for k, t in diffusers.items() if "lora_B" in k))


@pytest.mark.slow
def test_a_loha_file_names_only_modules_comfyui_maps_for_qwen_image(runs, tiny_qwen, data, pipe):
    """LyCORIS kinds keep the plain LoRA's `lora_unet_<path>` names: ComfyUI's QwenImage maps them (the generic
    map of model_lora_keys_unet), not OneTrainer's `lora_transformer_` ones (mapped for SD3 and Flux only)."""
    run_dir, final = launch(runs, _config(tiny_qwen, data, "devices=cpu:1", "batch.per_device=2", "name=loha",
                                          "lora.type=loha", "train.steps=1"))
    assert final["type"] == "done", log_of(run_dir)
    kohya = load_file(str(run_dir / "output" / "loha_kohya.safetensors"))
    linears = {n.replace(".", "_") for n, m in pipe.transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    modules = {key.split(".")[0] for key in kohya}
    assert modules and all(m.startswith("lora_unet_") and m.removeprefix("lora_unet_") in linears for m in modules)
    assert all(f"{m}.hada_w1_a" in kohya for m in modules)  # the LoHa tensors ComfyUI's loader reads
