"""FLUX.1 Kontext on its tiny offline model (the real FluxTransformer2DModel / FluxKontextPipeline classes, random
weights), trained on pairs (data.control_path):

- the training call is the pipeline's own: the target's packed tokens, then the control's, their position ids
  (the control's with first coordinate 1), dev's guidance, the prediction read at the target's tokens; the shift
  counts the target's tokens only, and the velocity target is what the pipeline's scheduler steps along;
- through the real launcher: a stopped run resumed on 2 processes gives an uninterrupted process's losses and
  weights, the LoRA file loads back through FluxKontextPipeline.load_lora_weights with exactly the trained
  weights, and the kohya/ComfyUI file names only modules of ComfyUI's Flux model.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests import flow_family_runs as flow_runs
from tests.flow_family_runs import runs  # noqa: F401  (fixture)
from trainer.core.config import load_config
from trainer.families.components import flow_matching as fm

PRESET = Path(__file__).resolve().parents[1] / "presets" / "demo-flux-kontext.yaml"


@pytest.fixture(scope="module")
def tiny_kontext(demo_asset):
    return demo_asset("tiny-flux-kontext")  # the demo's model, built once per session


@pytest.fixture(scope="module")
def pipe(tiny_kontext):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(tiny_kontext)


def _family(pipe, *overrides):
    """The family's hooks on a loaded pipeline, without load() (what the trainer would set)."""
    from trainer.families.flux_kontext.family import FluxKontextFamily

    config = load_config(None, ["model.family=flux_kontext", "data.control_path=controls", *overrides],
                         check_paths=False)
    family = FluxKontextFamily(SimpleNamespace(config=config, device=torch.device("cpu")))
    family.flow.pipe, family.flow.transformer = pipe, pipe.transformer
    family.flow.scheduler_config = dict(pipe.scheduler.config)
    return family


def test_the_training_call_is_the_pipelines_call(pipe):
    family = _family(pipe, "flow.max_sequence_length=16", "flow.guidance=2.5")
    text = family.encode_caption("make the background black")
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 16, 12, generator=gen)  # a 64x48 bucket's target latents, (B, C, H, W)
    control = torch.randn(2, 16, 16, 12, generator=gen)  # its control, normalized as the target
    sigmas = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        ours = family.forward(pipe.transformer, latents, sigmas,
                              {**{k: torch.cat([v, v]) for k, v in text.items()}, "control": control})
        # FluxKontextPipeline.__call__: prepare_latents takes latents as `image` when they have the latent channels
        # (lines 639-642) and packs them with ids whose first coordinate is 1 (656-663); the ids are concatenated
        # (962), the control's tokens after the target's (1038), the prediction cut to the target's (1052).
        packed = pipe._pack_latents(latents, 2, 16, 16, 12)
        scale = pipe.vae_scale_factor
        _, image_latents, latent_ids, image_ids = pipe.prepare_latents(control, 2, 16, 16 * scale, 12 * scale,
                                                                       latents.dtype, latents.device, None, packed)
        embeds, pooled, text_ids = pipe.encode_prompt("make the background black", prompt_2=None,
                                                      max_sequence_length=16)
        theirs = pipe.transformer(hidden_states=torch.cat([packed, image_latents], dim=1),
                                  timestep=(sigmas * 1000) / 1000, guidance=torch.full((2,), 2.5),
                                  pooled_projections=pooled.repeat(2, 1), encoder_hidden_states=embeds.repeat(2, 1, 1),
                                  txt_ids=text_ids, img_ids=torch.cat([latent_ids, image_ids]),
                                  return_dict=False)[0][:, :packed.shape[1]]
    assert (image_ids[:, 0] == 1).all() and (latent_ids[:, 0] == 0).all()
    torch.testing.assert_close(ours, pipe._unpack_latents(theirs, 16 * scale, 12 * scale, scale))


def test_the_shift_counts_the_target_tokens_and_the_target_is_the_schedulers_velocity(pipe):
    from diffusers.pipelines.flux.pipeline_flux_kontext import calculate_shift

    family = _family(pipe)
    s = pipe.scheduler.config
    # image_seq_len = latents.shape[1] (line 966): the target's 32 x 32 packed tokens at 512 px, not the control's
    mu = calculate_shift(32 * 32, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    assert family.shift((16, 64, 64)) == pytest.approx(math.exp(mu))

    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[0.9, 0.6, 0.3], mu=mu)
    sigma, after = scheduler.sigmas[0], scheduler.sigmas[1]
    noisy, target = fm.noisy_and_target(x0, noise, sigma.reshape(1))
    stepped = scheduler.step(target, scheduler.timesteps[0], noisy).prev_sample
    torch.testing.assert_close(stepped, (1 - after) * x0 + after * noise, rtol=1e-4, atol=1e-5)


# ---- through the real launcher ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """4 pairs of the edit demo's task: (targets with captions, controls)."""
    from trainer.families.components.edit_pairs import make_edit_pairs

    root = tmp_path_factory.mktemp("edit-pairs")
    return (make_edit_pairs(root / "targets", side="target", count=4),
            make_edit_pairs(root / "controls", side="control", count=4))


@pytest.fixture(scope="module")
def extra(pairs):
    return ("flow.max_sequence_length=16", f"data.control_path={pairs[1]}")


@pytest.fixture(scope="module")
def reference(runs, tiny_kontext, pairs, extra):
    return flow_runs.reference(runs, PRESET, tiny_kontext, pairs[0], *extra)


@pytest.mark.slow
def test_stopped_then_resumed_on_two_processes_matches_one_uninterrupted_process(reference, runs, tiny_kontext,
                                                                                pairs, extra):
    # With 2 swapped blocks (the reference has none): the control's tokens pass through blocks copied in for
    # their forward and recompute, and the weights are still the reference's.
    flow_runs.assert_resumed_on_two_processes_matches(reference, runs, PRESET, tiny_kontext, pairs[0], *extra,
                                                      "model.block_swap=2", "train.gradient_checkpointing=true")


@pytest.mark.slow
def test_the_lora_loads_back_and_the_comfyui_file_names_modules_of_comfyuis_flux(reference, tiny_kontext, pipe):
    """ComfyUI loads FLUX.1 Kontext as its Flux model (comfy/model_base.py `Flux`, the control as `ref_latents`),
    whose LoRA key map names every `diffusion_model.double_blocks...` / `single_blocks...` weight as
    `lora_unet_<path>` (comfy/lora.py, model_lora_keys_unet). Restated here: those paths and their out-widths from
    the model's config (ComfyUI is not installed)."""
    from diffusers import FluxKontextPipeline

    flow_runs.assert_lora_loads_back(FluxKontextPipeline, tiny_kontext, reference)
    config = pipe.transformer.config
    hidden = config.num_attention_heads * config.attention_head_dim
    mlp = 4 * hidden
    widths = {}
    for i in range(config.num_layers):
        for stream in ("img", "txt"):
            widths.update({f"double_blocks_{i}_{stream}_attn_qkv": 3 * hidden,
                           f"double_blocks_{i}_{stream}_attn_proj": hidden, f"double_blocks_{i}_{stream}_mlp_0": mlp,
                           f"double_blocks_{i}_{stream}_mlp_2": hidden})
    for i in range(config.num_single_layers):
        widths.update({f"single_blocks_{i}_linear1": 3 * hidden + mlp, f"single_blocks_{i}_linear2": hidden})
    kohya = load_file(str(reference / "output" / "ref_kohya.safetensors"))
    modules = {key.split(".")[0] for key in kohya}
    assert modules == {f"lora_unet_{name}" for name in widths}
    for module in modules:
        assert kohya[f"{module}.lora_up.weight"].shape[0] == widths[module.removeprefix("lora_unet_")]
