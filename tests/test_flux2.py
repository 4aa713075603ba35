"""FLUX.2 [dev] and [klein] on their tiny offline models (the real Flux2Transformer2DModel / AutoencoderKLFlux2 /
Flux2Pipeline / Flux2KleinPipeline classes, a tiny Mistral3 / Qwen3, random weights):

- the training call is each pipeline's own: the caption's stacked hidden states, the latents patchified,
  batch-normalised and packed with their ids, the timestep as sigma, dev's guidance input (klein has none); the
  velocity target is what the pipeline's scheduler steps along at its empirical mu;
- samples keep the pipeline's `is_distilled` (a step-distilled klein samples without CFG);
- through the real launcher (klein; dev's LoRA round trip too): 1 process and 2 processes give the same weights, a
  stopped-then-resumed run with swapped blocks (model.block_swap) the weights of an uninterrupted one without, and
  the LoRA file loads back through the pipeline's load_lora_weights with exactly the trained weights;
- every key of the ComfyUI file is one ComfyUI's Flux key map names, with the width it has there.
"""

from __future__ import annotations

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

PRESETS = Path(__file__).resolve().parents[1] / "presets"
PRESET = PRESETS / "demo-flux2-klein.yaml"
# family: (demo builder, pipeline class, its preset, max_sequence_length for the tiny tokenizers)
VARIANTS = {"flux2": ("make_tiny_flux2", "Flux2Pipeline", "demo-flux2.yaml", 96),
            "flux2_klein": ("make_tiny_flux2_klein", "Flux2KleinPipeline", "demo-flux2-klein.yaml", 32)}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    import trainer.families.flux2.demo as demo

    folder = tmp_path_factory.mktemp("flux2")
    return {name: getattr(demo, make)(folder / name) for name, (make, *_) in VARIANTS.items()}


@pytest.fixture(scope="module")
def pipes(tiny_models):
    import diffusers

    return {name: getattr(diffusers, VARIANTS[name][1]).from_pretrained(path) for name, path in tiny_models.items()}


@pytest.fixture(scope="module")
def tiny_klein(tiny_models):
    return tiny_models["flux2_klein"]


@pytest.fixture(scope="module")
def pipe(pipes):
    return pipes["flux2_klein"]


def _family(pipe, *overrides, name="flux2_klein"):
    """The family's hooks on a loaded pipeline, without load() (what the trainer would set)."""
    from trainer.families import get_family

    config = load_config(None, [f"model.family={name}", *overrides], check_paths=False)
    family = get_family(name)(SimpleNamespace(config=config, device=torch.device("cpu"), unwrap=lambda m: m))
    family.flow.pipe, family.flow.transformer, family.flow.vae = pipe, pipe.transformer, pipe.vae
    family.flow.scheduler_config = dict(pipe.scheduler.config)
    return family


@pytest.mark.parametrize("name", VARIANTS)
def test_the_training_call_is_the_pipelines_call(pipes, name):
    pipe, length = pipes[name], VARIANTS[name][3]
    guided = ["flow.guidance=3.5"] if name == "flux2" else []  # klein refuses the key (no guidance embedding)
    family = _family(pipe, f"flow.max_sequence_length={length}", *guided, name=name)
    caption = "a photo of a red circle"
    text = family.encode_caption(caption)
    embeds, text_ids = pipe.encode_prompt(caption, max_sequence_length=length)
    torch.testing.assert_close(text["embeds"], embeds)
    # hidden states 10/20/30 (dev) or 9/18/27 (klein) side by side
    width = pipe.text_encoder.config.get_text_config().hidden_size
    assert embeds.shape == (1, length, 3 * width) == (1, length, pipe.transformer.config.joint_attention_dim)

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(2, 8, 16, 16, generator=gen)  # (B, C, H, W) as the VAE gives them
    latents = family.normalize_latents(z)
    # Both pipelines undo the batch norm on patchified latents before decoding (pipeline_flux2.py:1019-1024)
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    torch.testing.assert_close(pipe._unpatchify_latents(pipe._patchify_latents(latents) * std + mean), z)
    assert not torch.allclose(latents, z)

    sigmas = torch.tensor([0.3, 0.8])
    # dev: the distilled guidance as a (B,) tensor (lines 951-952); klein: None (pipeline_flux2_klein.py:854)
    guidance = torch.full([2], 3.5) if name == "flux2" else None
    with torch.no_grad():
        ours = family.forward(pipe.transformer, latents, sigmas, {"embeds": torch.cat([text["embeds"]] * 2)})
        # the pipelines' __call__: patchified, packed latents and their ids, t / 1000
        patched = pipe._patchify_latents(latents)
        latent_ids = pipe._prepare_latent_ids(patched)
        theirs = pipe.transformer(hidden_states=pipe._pack_latents(patched), timestep=(sigmas * 1000) / 1000,
                                  guidance=guidance, encoder_hidden_states=embeds.repeat(2, 1, 1),
                                  txt_ids=text_ids.repeat(2, 1, 1), img_ids=latent_ids, return_dict=False)[0]
        if guidance is not None:  # the guidance input is live: another value is another prediction
            other = pipe.transformer(hidden_states=pipe._pack_latents(patched), timestep=sigmas, guidance=guidance + 1,
                                     encoder_hidden_states=embeds.repeat(2, 1, 1), txt_ids=text_ids.repeat(2, 1, 1),
                                     img_ids=latent_ids, return_dict=False)[0]
            assert not torch.allclose(theirs, other)
    unpacked = pipe._unpack_latents_with_ids(theirs, latent_ids)
    if isinstance(unpacked, list):  # Flux2Pipeline returns a list, klein's a (B, C, h, w) tensor (0.42)
        unpacked = torch.stack(unpacked)
    torch.testing.assert_close(ours, pipe._unpatchify_latents(unpacked))


def test_the_target_is_what_the_schedulers_steps_integrate(pipe):
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    assert _family(pipe).shift((8, 64, 64)) == 1.0  # dynamic shifting: diffusers' scripts train unshifted
    assert _family(pipe, "flow.shift=2.0").shift((8, 64, 64)) == 2.0
    # The Euler step at the pipeline's own mu (256 tokens, 4 steps) along the velocity the loss regresses
    # (noise - x0) lands on the interpolation at the next sigma.
    x0, noise = torch.randn(1, 8, 16, 16), torch.randn(1, 8, 16, 16)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25], mu=compute_empirical_mu(256, 4))
    sigma, after = scheduler.sigmas[1], scheduler.sigmas[2]
    noisy, target = fm.noisy_and_target(x0, noise, sigma.reshape(1))
    stepped = scheduler.step(target, scheduler.timesteps[1], noisy).prev_sample
    torch.testing.assert_close(stepped, (1 - after) * x0 + after * noise, rtol=1e-4, atol=1e-5)


def test_samples_keep_the_pipelines_is_distilled(tiny_klein):
    from diffusers import Flux2KleinPipeline

    distilled = Flux2KleinPipeline.from_pretrained(tiny_klein, is_distilled=True)
    for source in (distilled, Flux2KleinPipeline.from_pretrained(tiny_klein)):
        rebuilt = _family(source).flow._sampling_pipeline(from_cache=True)
        assert rebuilt.config.is_distilled == source.config.is_distilled
        assert rebuilt.text_encoder is None and rebuilt.transformer is source.transformer


def test_keys_without_effect_are_refused_with_the_reason():
    for preset in ("demo-flux2.yaml", "demo-flux2-klein.yaml"):
        with pytest.raises(ConfigError, match="sample.negative_prompt: 'blurry' has no effect on FLUX.2"):
            load_config(PRESETS / preset, ["sample.negative_prompt=blurry"], check_paths=False)
    with pytest.raises(ConfigError, match="flow.guidance: 3.5 feeds FLUX.2 \\[dev\\]'s guidance embedding"):
        load_config(PRESET, ["flow.guidance=3.5"], check_paths=False)
    load_config(PRESETS / "demo-flux2.yaml", ["flow.guidance=3.5"], check_paths=False)  # dev has the embedding


# ---- through the real launcher ----------------------------------------------------------------------------------

EXTRA = ("flow.max_sequence_length=32",)


@pytest.fixture(scope="module")
def reference(runs, tiny_klein, data):
    return flow_runs.reference(runs, PRESET, tiny_klein, data, *EXTRA)


@pytest.mark.slow
def test_the_lora_loads_back_through_the_pipeline(reference, tiny_klein):
    from diffusers import Flux2KleinPipeline

    flow_runs.assert_lora_loads_back(Flux2KleinPipeline, tiny_klein, reference)


@pytest.mark.slow
def test_dev_trains_and_its_lora_loads_back_with_the_comfyui_keys(runs, tiny_models, pipes, data):
    from diffusers import Flux2Pipeline

    run_dir = flow_runs.train(runs, PRESETS / "demo-flux2.yaml", tiny_models["flux2"], data,
                              "flow.max_sequence_length=96", "devices=cpu:1", "batch.per_device=2", "name=dev",
                              "flow.guidance=3.5")
    flow_runs.assert_lora_loads_back(Flux2Pipeline, tiny_models["flux2"], run_dir)
    _assert_comfyui_keys(run_dir / "output" / "dev_kohya.safetensors", pipes["flux2"].transformer.config)


@pytest.mark.slow
def test_stopped_then_resumed_on_two_processes_matches_one_uninterrupted_process(reference, runs, tiny_klein, data):
    """With model.block_swap (trainer.families.components.block_swap), which the other families' runs leave off: on
    the CPU it copies each swapped block's weights in for its forward and its recompute, and the run gives the
    losses and weights of the reference without it, on 1 and 2 processes (DDP leaving the CPU-held weights alone)
    and across the resume. Checkpointing does not change FLUX.2's fp32 results (Chroma's it does: diffusers drops
    the attention mask in its checkpointed single blocks)."""
    flow_runs.assert_resumed_on_two_processes_matches(reference, runs, PRESET, tiny_klein, data, *EXTRA,
                                                      "model.block_swap=2", "train.gradient_checkpointing=true")


def _comfy_flux2_lora_keys(config) -> dict[str, tuple[str, int]]:
    """ComfyUI's LoRA key map for FLUX.2, restated (ComfyUI is not installed): comfy/lora.py model_lora_keys_unet,
    the `isinstance(model, comfy.model_base.Flux)` branch (`class Flux2(Flux)`), maps `transformer.<key>` for
    every `.weight` key of comfy/utils.py flux_to_diffusers onto ComfyUI's weight; FLUX.2's diffusers names there:
    q/k/v (and add_*_proj) onto thirds of the fused img/txt qkv, `attn.to_out.0` / `attn.to_add_out` onto
    img/txt_attn.proj, `ff(_context).linear_in/out` onto img/txt_mlp.0/2, and in the single blocks
    `attn.to_qkv_mlp_proj` onto linear1, `attn.to_out` onto linear2 ("# Flux 2"). Here: {LoRA key: (ComfyUI
    weight, its out-width for this LoRA)}; only the Linear layers."""
    hidden = config.num_attention_heads * config.attention_head_dim
    mlp = int(hidden * config.mlp_ratio)
    out: dict[str, tuple[str, int]] = {}
    for i in range(config.num_layers):
        source, target = f"transformer.transformer_blocks.{i}", f"diffusion_model.double_blocks.{i}"
        for stream, prefix in (("img", ""), ("txt", "add_")):
            for name in "qkv":
                key = f"{source}.attn.to_{name}" if stream == "img" else f"{source}.attn.{prefix}{name}_proj"
                out[key] = (f"{target}.{stream}_attn.qkv.weight", hidden)
        out[f"{source}.attn.to_out.0"] = (f"{target}.img_attn.proj.weight", hidden)
        out[f"{source}.attn.to_add_out"] = (f"{target}.txt_attn.proj.weight", hidden)
        for ff, stream in (("ff", "img"), ("ff_context", "txt")):
            out[f"{source}.{ff}.linear_in"] = (f"{target}.{stream}_mlp.0.weight", 2 * mlp)  # SwiGLU: gate + up
            out[f"{source}.{ff}.linear_out"] = (f"{target}.{stream}_mlp.2.weight", hidden)
    for i in range(config.num_single_layers):
        source, target = f"transformer.single_transformer_blocks.{i}", f"diffusion_model.single_blocks.{i}"
        out[f"{source}.attn.to_qkv_mlp_proj"] = (f"{target}.linear1.weight", 3 * hidden + 2 * mlp)
        out[f"{source}.attn.to_out"] = (f"{target}.linear2.weight", hidden)
    return out


@pytest.mark.slow
def test_every_key_of_the_comfyui_file_is_in_comfyuis_flux_key_map(reference, pipe):
    _assert_comfyui_keys(reference / "output" / "ref_kohya.safetensors", pipe.transformer.config)


def _assert_comfyui_keys(file: Path, config) -> None:
    comfy = _comfy_flux2_lora_keys(config)
    kohya = load_file(str(file))
    modules = {key.rsplit(".", 2)[0] if ".lora_" in key else key.removesuffix(".alpha") for key in kohya}
    # every adapted layer (12 in each of 2 double blocks, 2 in each of 2 single blocks), each one ComfyUI maps
    assert len(modules) == 12 * 2 + 2 * 2 and modules <= comfy.keys()
    for module in modules:
        assert set(k for k in kohya if k.startswith(module + ".")) == {
            f"{module}.lora_A.weight", f"{module}.lora_B.weight", f"{module}.alpha"}
        assert kohya[f"{module}.lora_B.weight"].shape[0] == comfy[module][1]
        assert kohya[f"{module}.alpha"].item() == 4.0  # the demo's lora.alpha: ComfyUI scales by alpha / rank
