"""Z-Image on its tiny offline model (the real ZImageTransformer2DModel / ZImagePipeline classes, a tiny Qwen3
encoder, random weights):

- the training call is the pipeline's own: the chat-templated caption's second-to-last Qwen3 hidden state without
  its padding, a list of (C, 1, H, W) latents, the timestep as (1000 - t) / 1000, the output negated; the shift is
  the scheduler's; the target noise - x0 is what the pipeline's scheduler steps along;
- samples drawn from the cached embeddings are the pipeline's samples from the prompt (with and without guidance);
- a training adapter (flow.training_adapter) gives the output of its weights merged into the frozen ones, through
  the trained LoRA, and the base's output when off for samples; a run with one saves only its own LoRA;
- through the real launcher: 1 process and 2 processes give the same weights, a stopped-then-resumed run the
  weights of an uninterrupted one, and the LoRA file loads back through ZImagePipeline.load_lora_weights with
  exactly the trained weights;
- every key of the ComfyUI file is one ComfyUI's Lumina2 key map names, onto a weight of the width it has there.
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
from tests.engine_helpers import final_weights, launch, log_of, progress
from trainer.core.config import load_config
from trainer.errors import ConfigError
from trainer.families.components import flow_matching as fm

PRESET = Path(__file__).resolve().parents[1] / "presets" / "demo-zimage.yaml"


@pytest.fixture(scope="module")
def tiny_zimage(demo_asset):
    return demo_asset("tiny-zimage")  # the demo's model, built once per session


@pytest.fixture(scope="module")
def pipe(tiny_zimage):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(tiny_zimage)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _family(pipe, *overrides):
    """The Z-Image family's hooks on a loaded pipeline, without load() (what the trainer would set)."""
    from trainer.families.zimage.family import ZImageFamily

    config = load_config(None, ["model.family=zimage", *overrides], check_paths=False)
    family = ZImageFamily(SimpleNamespace(config=config, device=torch.device("cpu")))
    family.flow.pipe, family.flow.transformer = pipe, pipe.transformer
    family.flow.text_encoders = [pipe.text_encoder]
    family.flow.scheduler_config = dict(pipe.scheduler.config)
    return family


def test_the_training_call_is_the_pipelines_call(pipe):
    family = _family(pipe, "flow.max_sequence_length=48")
    captions = ["a photo of a red circle", "a blue square"]
    texts = [family.encode_caption(c) for c in captions]
    (first,), _ = pipe.encode_prompt(captions[0], do_classifier_free_guidance=False, max_sequence_length=48)
    length = int(texts[0]["mask"].sum())
    assert texts[0]["embeds"].shape == (1, 48, 32) and length == first.shape[0]
    torch.testing.assert_close(texts[0]["embeds"][0, :length], first)
    assert texts[0]["embeds"][0, length:].abs().sum() == 0  # the padding carries nothing
    # Different lengths: the padding has to come off again, per caption, for the transformer
    assert int(texts[1]["mask"].sum()) != length

    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 16, 16, generator=gen)  # (B, C, H, W) as the VAE gives them
    sigmas = torch.tensor([0.3, 0.8])
    batch = {k: torch.cat([t[k] for t in texts]) for k in texts[0]}
    with torch.no_grad():
        ours = family.forward(pipe.transformer, latents, sigmas, batch)
        # ZImagePipeline.__call__, lines 509-568: t = 1000 sigma from the scheduler, (1000 - t) / 1000, a list of
        # (C, 1, H, W) latents, the list of unpadded embeddings, and the output negated before the scheduler step
        embeds = [pipe.encode_prompt(c, do_classifier_free_guidance=False, max_sequence_length=48)[0][0]
                  for c in captions]
        t = sigmas * 1000
        out = pipe.transformer(list(latents.unsqueeze(2).unbind(dim=0)), (1000 - t) / 1000, embeds,
                               return_dict=False)[0]
        theirs = -torch.stack([o.float() for o in out], dim=0).squeeze(2)
    torch.testing.assert_close(ours, theirs)


def test_the_shift_is_the_schedulers_and_the_target_is_its_velocity(pipe):
    from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift

    family = _family(pipe)
    assert family.shift((16, 64, 64)) == 3.0  # Turbo's static shift: the scheduler ignores mu without dynamic shift
    assert _family(pipe, "flow.shift=2.0").shift((16, 64, 64)) == 2.0
    family.flow.scheduler_config = {**pipe.scheduler.config, "use_dynamic_shifting": True}
    s = pipe.scheduler.config
    mu = calculate_shift(32 * 32, s.get("base_image_seq_len", 256), s.get("max_image_seq_len", 4096),
                         s.get("base_shift", 0.5), s.get("max_shift", 1.15))  # as the pipeline, lines 471-480
    assert family.shift((16, 64, 64)) == pytest.approx(math.exp(mu))

    # The pipeline steps its scheduler along -(model output) (line 568), which `forward` returns: the Euler step
    # along the target noise - x0 lands on the interpolation at the next sigma.
    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[1.0, 0.5, 0.25], mu=mu)  # get_default_z_image_sigmas(3) shape, then shifted
    sigma, after = scheduler.sigmas[0], scheduler.sigmas[1]
    assert sigma.item() == pytest.approx(1.0) and after.item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5))
    noisy, target = fm.noisy_and_target(x0, noise, sigma.reshape(1))
    stepped = scheduler.step(target, scheduler.timesteps[0], noisy).prev_sample
    torch.testing.assert_close(stepped, (1 - after) * x0 + after * noise, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_samples_from_the_cached_embeddings_are_the_pipelines(pipe, guidance):
    """The trainer samples from its text cache (FlowTransformerTrainer.sample): the padded cache entries go back to
    the pipeline as its list of unpadded embeddings, repeated per image; with guidance the negative's too."""
    from trainer.families.flow.trainer import _repeated

    family = _family(pipe, "flow.max_sequence_length=48")
    family.flow.cached = family.encode_caption  # what the cache holds: the hook's own encoding
    prompt, negative = "a photo of a red circle", "blurry"
    common = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": guidance,
              "output_type": "latent", "max_sequence_length": 48}
    with torch.no_grad():
        cached = {k: _repeated(v, 2) for k, v in family.embedded_prompt_kwargs(prompt, negative).items()}
        ours = pipe(**cached, generator=torch.Generator().manual_seed(1), **common).images
        theirs = pipe(prompt, negative_prompt=negative, num_images_per_prompt=2,
                      generator=torch.Generator().manual_seed(1), **common).images
    assert ours.shape[0] == 2
    torch.testing.assert_close(ours, theirs)


def _adapter_file(transformer, path: Path) -> Path:
    """A random "training adapter" as ai-toolkit writes one (z_image.py:108-116, 469-473): diffusers paths under
    `diffusion_model.`, lora_A / lora_B, here with an alpha (2 over rank 4: scale 0.5) on a few kinds of layer."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(5)
    state = {}
    for module in ("layers.0.attention.to_q", "layers.1.feed_forward.w2", "noise_refiner.0.adaLN_modulation.0",
                   "all_x_embedder.2-1", "cap_embedder.1"):
        layer = transformer.get_submodule(module)
        state[f"diffusion_model.{module}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=gen)
        state[f"diffusion_model.{module}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=gen) * 0.1
        state[f"diffusion_model.{module}.alpha"] = torch.tensor(2.0)
    save_file(state, str(path))
    return path


def test_the_training_adapter_is_its_merged_weights_and_off_for_samples(tiny_zimage, pipe, tmp_path):
    """ai-toolkit merges the adapter into the frozen weights for training and removes it for samples; the hooks
    give the merged model's output, through the LoRA peft wraps around the same layers, and the base's when off."""
    from diffusers import ZImageTransformer2DModel
    from peft import LoraConfig

    from trainer.families.flow.training_adapter import TrainingAdapter, read_adapter

    family = _family(pipe, "flow.max_sequence_length=48")
    file = _adapter_file(pipe.transformer, tmp_path / "adapter.safetensors")
    hooked = ZImageTransformer2DModel.from_pretrained(tiny_zimage / "transformer")
    merged = ZImageTransformer2DModel.from_pretrained(tiny_zimage / "transformer")
    state = read_adapter(str(file))
    with torch.no_grad():
        for key, a in state.items():
            if key.endswith(".lora_A.weight"):
                module = key.removeprefix("diffusion_model.").removesuffix(".lora_A.weight")
                b = state[f"diffusion_model.{module}.lora_B.weight"]
                merged.get_submodule(module).weight += 0.5 * b @ a
    adapter = TrainingAdapter(hooked, state, torch.device("cpu"))
    hooked.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "w2"]))  # B = 0: the base's output

    text = family.encode_caption("a photo of a red circle")
    latents, sigmas = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0.6])
    with torch.no_grad():
        trained = family.forward(hooked, latents, sigmas, text)
        torch.testing.assert_close(trained, family.forward(merged, latents, sigmas, text))
        with adapter.off():
            torch.testing.assert_close(family.forward(hooked, latents, sigmas, text),
                                       family.forward(pipe.transformer, latents, sigmas, text))
        assert not torch.allclose(trained, family.forward(pipe.transformer, latents, sigmas, text))

    from trainer.errors import UserError

    with pytest.raises(UserError, match="not in this transformer"):
        TrainingAdapter(merged, {"diffusion_model.nowhere.lora_A.weight": torch.zeros(1, 1),
                                 "diffusion_model.nowhere.lora_B.weight": torch.zeros(1, 1)}, torch.device("cpu"))


def test_flux_only_keys_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="flow.guidance: 3.5 feeds FLUX.1-dev's guidance embedding"):
        load_config(PRESET, ["flow.guidance=3.5"], check_paths=False)
    with pytest.raises(ConfigError, match="flow.lora_blocks: double picks FLUX's double or single blocks"):
        load_config(PRESET, ["flow.lora_blocks=double"], check_paths=False)


# ---- through the real launcher ----------------------------------------------------------------------------------

EXTRA = ("flow.max_sequence_length=48",)


def _config(tiny_zimage, data, *overrides):
    return flow_config(PRESET, tiny_zimage, data, *EXTRA, *overrides)


@pytest.fixture(scope="module")
def reference(runs, tiny_zimage, data):
    return flow_runs.reference(runs, PRESET, tiny_zimage, data, *EXTRA)


@pytest.mark.slow
def test_the_lora_loads_back_through_the_pipeline(reference, tiny_zimage):
    from diffusers import ZImagePipeline

    flow_runs.assert_lora_loads_back(ZImagePipeline, tiny_zimage, reference)


@pytest.mark.slow
def test_stopped_then_resumed_on_two_processes_matches_one_uninterrupted_process(reference, runs, tiny_zimage, data):
    flow_runs.assert_resumed_on_two_processes_matches(reference, runs, PRESET, tiny_zimage, data, *EXTRA)


@pytest.mark.slow
def test_a_run_with_a_training_adapter_trains_and_saves_only_its_lora(reference, runs, tiny_zimage, data, pipe,
                                                                       tmp_path):
    file = _adapter_file(pipe.transformer, tmp_path / "adapter.safetensors")
    config = _config(tiny_zimage, data, "devices=cpu:1", "batch.per_device=2", "name=adapter", "sample.every=4",
                     f"flow.training_adapter={file}")
    run_dir, final = launch(runs, config)
    assert final["type"] == "done", log_of(run_dir)
    ours, plain = final_weights(run_dir), final_weights(reference)
    assert ours.keys() == plain.keys()  # the adapter is not trained, not saved
    # ... but it acted on every step: the losses and the trained LoRA differ from the plain run's
    assert [e["loss"] for e in progress(run_dir)] != pytest.approx([e["loss"] for e in progress(reference)])
    assert any(not torch.allclose(ours[k], plain[k]) for k in ours)
    assert load_file(str(run_dir / "output" / "pytorch_lora_weights.safetensors")).keys() == \
        load_file(str(reference / "output" / "pytorch_lora_weights.safetensors")).keys()


def _comfy_lumina2_lora_keys(config) -> dict[str, tuple[str, int]]:
    """ComfyUI's LoRA key map for Z-Image, restated (ComfyUI is not installed): comfy/lora.py model_lora_keys_unet,
    the `isinstance(model, comfy.model_base.Lumina2)` branch, maps `diffusion_model.<key>` for every `.weight` key
    of comfy/utils.py z_image_to_diffusers onto ComfyUI's weight, to_q/to_k/to_v onto thirds of the fused
    `attention.qkv`. Here: {LoRA key: (ComfyUI weight, its out-width for this LoRA)}; only the Linear layers."""
    dim, hidden = config.dim, int(config.dim / 3 * 8)
    out: dict[str, tuple[str, int]] = {}
    blocks = [f"layers.{i}" for i in range(config.n_layers)]
    blocks += [f"{kind}.{i}" for kind in ("context_refiner", "noise_refiner") for i in range(config.n_refiner_layers)]
    for block in blocks:
        target = f"diffusion_model.{block}"
        for name in ("to_q", "to_k", "to_v"):
            out[f"diffusion_model.{block}.attention.{name}"] = (f"{target}.attention.qkv.weight", dim)
        out[f"diffusion_model.{block}.attention.to_out.0"] = (f"{target}.attention.out.weight", dim)
        for name, width in (("w1", hidden), ("w2", dim), ("w3", hidden)):
            out[f"diffusion_model.{block}.feed_forward.{name}"] = (f"{target}.feed_forward.{name}.weight", width)
        out[f"diffusion_model.{block}.adaLN_modulation.0"] = (f"{target}.adaLN_modulation.0.weight", 4 * dim)
    return out


@pytest.mark.slow
def test_every_key_of_the_comfyui_file_is_in_comfyuis_lumina2_key_map(reference, pipe):
    comfy = _comfy_lumina2_lora_keys(pipe.transformer.config)
    kohya = load_file(str(reference / "output" / "ref_kohya.safetensors"))
    modules = {key.rsplit(".", 2)[0] if ".lora_" in key else key.removesuffix(".alpha") for key in kohya}
    # every adapted layer (3 attention projections, out, 3 MLP layers in 4 blocks), each one ComfyUI maps
    assert len(modules) == 7 * 4 and modules <= comfy.keys()
    for module in modules:
        assert set(k for k in kohya if k.startswith(module + ".")) == {
            f"{module}.lora_A.weight", f"{module}.lora_B.weight", f"{module}.alpha"}
        assert kohya[f"{module}.lora_B.weight"].shape[0] == comfy[module][1]
        assert kohya[f"{module}.alpha"].item() == 4.0  # the demo's lora.alpha: ComfyUI scales by alpha / rank


@pytest.mark.slow
def test_lokr_and_loha_files_name_only_keys_of_comfyuis_lumina2_key_map(runs, tiny_zimage, data, pipe):
    """LyCORIS kinds have no diffusers file: the ComfyUI file is all a user loads. ComfyUI's Lumina2 branch maps
    `diffusion_model.<diffusers path>` (as the LoRA file's), not OneTrainer's `lora_transformer_` names, which it
    maps for its Flux model only: every module of ours must be one of its keys, with the tensors its LoKr / LoHa
    adapters read (comfy/weight_adapter/lokr.py, loha.py: `<name>.lokr_w1`..., `<name>.hada_w1_a`..., `.alpha`)."""
    comfy = _comfy_lumina2_lora_keys(pipe.transformer.config)
    for kind, tensor in (("lokr", "lokr_w1"), ("loha", "hada_w1_a")):
        run_dir, final = launch(runs, _config(tiny_zimage, data, "devices=cpu:1", "batch.per_device=2",
                                              f"name={kind}", f"lora.type={kind}", "train.steps=1"))
        assert final["type"] == "done", log_of(run_dir)
        kohya = load_file(str(run_dir / "output" / f"{kind}_kohya.safetensors"))
        modules = {key.rsplit(".", 1)[0] for key in kohya}
        assert len(modules) == 7 * 4 and modules <= comfy.keys()
        assert all(f"{m}.{tensor}" in kohya and f"{m}.alpha" in kohya for m in modules)
