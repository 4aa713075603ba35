"""Qwen-Image-Edit (2509/2511, QwenImageEditPlusPipeline) on its tiny offline model (the real
QwenImageTransformer2DModel with zero_cond_t, AutoencoderKLQwenImage, Qwen2.5-VL with its vision tower, a
Qwen2VLProcessor; random weights), trained on pairs (data.control_path):

- the text embedding is the pipeline's own for (instruction, control image): the control resized to the
  pipeline's 384² condition image, through the processor's vision tokens and the edit template; a changed control
  image is a new cache key and a new embedding;
- the training call is the pipeline's own: the target's packed tokens then the control's, img_shapes target then
  control (which zero_cond_t reads), the prediction cut to the target's tokens, padded embeddings trimmed or
  masked as a one-prompt call gives; the shift counts the target's tokens; the target is the scheduler's velocity;
- through the real launcher: a stopped run resumed on 2 processes gives an uninterrupted process's losses and
  weights, the LoRA loads back through QwenImageEditPlusPipeline.load_lora_weights with exactly the trained
  weights, and the kohya/ComfyUI file names only modules of ComfyUI's QwenImage model, with the alphas.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from tests import flow_family_runs as flow_runs
from tests.flow_family_runs import runs  # noqa: F401  (fixture)
from trainer.core.config import load_config
from trainer.errors import ConfigError
from trainer.families.components import flow_matching as fm

PRESET = Path(__file__).resolve().parents[1] / "presets" / "demo-qwenimage-edit.yaml"
INSTRUCTION = "make the background black"


@pytest.fixture(scope="module")
def tiny_edit(demo_asset):
    return demo_asset("tiny-qwenimage-edit")  # the demo's model, built once per session


@pytest.fixture(scope="module")
def pipe(tiny_edit):
    from diffusers import QwenImageEditPlusPipeline

    return QwenImageEditPlusPipeline.from_pretrained(tiny_edit)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """4 pairs of the edit demo's task: (targets with captions, controls)."""
    from trainer.families.components.edit_pairs import make_edit_pairs

    root = tmp_path_factory.mktemp("edit-pairs")
    return (make_edit_pairs(root / "targets", side="target", count=4),
            make_edit_pairs(root / "controls", side="control", count=4))


def _family(pipe, *overrides):
    """The family's hooks on a loaded pipeline, without load() (what the trainer would set)."""
    from trainer.families.qwenimage_edit.family import QwenImageEditFamily

    config = load_config(None, ["model.family=qwenimage_edit", "data.control_path=controls", "data.flip=false",
                                *overrides], check_paths=False)
    family = QwenImageEditFamily(SimpleNamespace(config=config, device=torch.device("cpu")))
    family.flow.pipe, family.flow.transformer, family.flow.vae = pipe, pipe.transformer, pipe.vae
    family.flow.scheduler_config = dict(pipe.scheduler.config)
    return family


def _condition_image(pipe, path):
    """QwenImageEditPlusPipeline.__call__'s condition image (lines 697-705), from its own functions."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    image = Image.open(path).convert("RGB")
    width, height = calculate_dimensions(CONDITION_IMAGE_SIZE, image.width / image.height)
    return pipe.image_processor.resize(image, height, width)


def test_the_text_embedding_is_the_pipelines_for_the_instruction_and_its_control_image(pipe, pairs, tmp_path):
    family = _family(pipe, "flow.max_sequence_length=128")
    controls = sorted(pairs[1].glob("*.png"))
    text = family.encode_caption(family.text_key(INSTRUCTION, str(controls[0])))
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(INSTRUCTION, image=[_condition_image(pipe, controls[0])])
    n = int(text["mask"].sum())
    assert mask is None and n == embeds.shape[1] and text["embeds"].shape[1] == 128
    torch.testing.assert_close(text["embeds"][:, :n], embeds)
    assert text["embeds"][:, n:].abs().sum() == 0
    # The vision tokens are in it: another control image, the same instruction, another embedding
    other = family.encode_caption(family.text_key(INSTRUCTION, str(controls[1])))
    assert not torch.allclose(other["embeds"][:, :n], text["embeds"][:, :n])
    # The cache key follows the file's content: the same bytes keep it, a changed image changes it
    copy = tmp_path / "control.png"
    copy.write_bytes(controls[0].read_bytes())
    key = family.text_key(INSTRUCTION, str(copy))
    assert family.text_key(INSTRUCTION, str(copy)) == key
    Image.open(controls[1]).save(copy)
    os.utime(copy, ns=(1, 1))  # another version of the file even on a coarse clock
    assert family.text_key(INSTRUCTION, str(copy)) != key
    with pytest.raises(Exception, match="flow.max_sequence_length: the caption"):
        _family(pipe, "flow.max_sequence_length=8").encode_caption(key)


def test_the_training_call_is_the_pipelines_call(pipe, pairs):
    family = _family(pipe, "flow.max_sequence_length=128")
    controls = sorted(pairs[1].glob("*.png"))[:2]
    captions = [INSTRUCTION, "make the background of the red circle black"]  # two lengths: padded, masked
    texts = [family.encode_caption(family.text_key(c, str(p))) for c, p in zip(captions, controls)]
    assert texts[0]["mask"].sum() < texts[1]["mask"].sum()
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 16, 8, 6, generator=gen)  # a 64x48 bucket's target latents, (B, C, h, w)
    control = torch.randn(2, 16, 6, 8, generator=gen)  # a control of another shape: img_shapes tells them apart
    sigmas = torch.tensor([0.3, 0.8])
    batch = {k: torch.cat([t[k] for t in texts]) for k in texts[0]}
    with torch.no_grad():
        ours = family.forward(pipe.transformer, latents, sigmas, {**batch, "control": control})
        scale = pipe.vae_scale_factor
        for i in range(2):  # the pipeline draws one prompt at a time (lines 681-686): one call per pair
            embeds, mask = pipe.encode_prompt(captions[i], image=[_condition_image(pipe, controls[i])])
            packed = pipe._pack_latents(latents[i:i + 1], 1, 16, 8, 6)
            # prepare_latents takes a control with the latent channels as its latents (lines 471-474), packs it
            # (487) after the given target latents; img_shapes: the target's, then the control's (753-761)
            target, control_tokens = pipe.prepare_latents([control[i:i + 1, :, None]], 1, 16, 8 * scale, 6 * scale,
                                                          latents.dtype, latents.device, None, packed)
            img_shapes = [[(1, 8 // 2, 6 // 2), (1, 6 // 2, 8 // 2)]]
            pred = pipe.transformer(hidden_states=torch.cat([target, control_tokens], dim=1),
                                    timestep=(sigmas[i:i + 1] * 1000) / 1000, encoder_hidden_states=embeds,
                                    encoder_hidden_states_mask=mask, img_shapes=img_shapes,
                                    return_dict=False)[0][:, :target.size(1)]  # line 826
            theirs = pipe._unpack_latents(pred, 8 * scale, 6 * scale, scale)[:, :, 0]
            torch.testing.assert_close(ours[i:i + 1], theirs, rtol=1e-4, atol=1e-5)
        # zero_cond_t reads img_shapes: the control's tokens are modulated as the condition, not as the target
        swapped = pipe.transformer(hidden_states=torch.cat([target, control_tokens], dim=1), timestep=sigmas[1:],
                                   encoder_hidden_states=embeds, img_shapes=[[(1, 3, 4), (1, 4, 3)]],
                                   return_dict=False)[0][:, :target.size(1)]
    assert pipe.transformer.config.zero_cond_t
    assert not torch.allclose(pipe._unpack_latents(swapped, 64, 48, scale)[:, :, 0], ours[1:], atol=1e-4)


def test_the_shift_counts_the_target_tokens_and_the_target_is_the_schedulers_velocity(pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_shift

    family = _family(pipe)
    s = pipe.scheduler.config
    # image_seq_len = latents.shape[1] (line 765): the target's 64 x 64 packed tokens at 1024 px, not the control's
    mu = calculate_shift(64 * 64, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
    assert family.shift((16, 128, 128)) == pytest.approx(math.exp(mu))

    x0, noise = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(sigmas=[0.9, 0.6, 0.3], mu=mu)
    sigma, after = scheduler.sigmas[0], scheduler.sigmas[1]
    noisy, target = fm.noisy_and_target(x0, noise, sigma.reshape(1))
    stepped = scheduler.step(target, scheduler.timesteps[0], noisy).prev_sample
    torch.testing.assert_close(stepped, (1 - after) * x0 + after * noise, rtol=1e-4, atol=1e-5)


def test_control_latents_are_normalised_as_the_pipeline_encodes_its_image(pipe):
    family = _family(pipe)
    pixels = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        ours = family.normalize_latents(family.image_vae(pipe.vae).encode(pixels).latent_dist.mean)
        theirs = pipe._encode_vae_image(pixels[:, :, None], None)[:, :, 0]  # lines 422-443: mode, mean/std
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_keys_without_meaning_here_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="data.flip: Qwen-Image-Edit's text encoder"):
        load_config(PRESET, ["data.flip=true"], check_paths=False)
    with pytest.raises(ConfigError, match="flow.guidance: 3.5 feeds FLUX.1-dev's guidance embedding"):
        load_config(PRESET, ["flow.guidance=3.5"], check_paths=False)
    with pytest.raises(ConfigError, match="data.control_path: qwenimage_edit trains instruction edits"):
        load_config(None, ["model.family=qwenimage_edit"], check_paths=False)


# ---- through the real launcher ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def extra(pairs):
    return ("lora.alpha=2", f"data.control_path={pairs[1]}")  # alpha != rank: the ComfyUI file must carry it


@pytest.fixture(scope="module")
def reference(runs, tiny_edit, pairs, extra):
    return flow_runs.reference(runs, PRESET, tiny_edit, pairs[0], *extra)


@pytest.mark.slow
def test_stopped_then_resumed_on_two_processes_matches_one_uninterrupted_process(reference, runs, tiny_edit,
                                                                                pairs, extra):
    flow_runs.assert_resumed_on_two_processes_matches(reference, runs, PRESET, tiny_edit, pairs[0], *extra)


@pytest.mark.slow
def test_the_lora_loads_back_and_the_comfyui_file_names_modules_of_comfyuis_qwen_image(reference, tiny_edit, pipe):
    """ComfyUI runs Qwen-Image-Edit as its QwenImage model (comfy/supported_models.py, the control as
    `reference_latents`), whose Linear layers carry diffusers' names; comfy/lora.py's model_lora_keys_unet maps
    `lora_unet_<path>` (dots as underscores) onto each `diffusion_model.<path>.weight` and reads `<name>.alpha`.
    Restated here: the transformer's own Linear layers (ComfyUI is not installed)."""
    from diffusers import QwenImageEditPlusPipeline

    flow_runs.assert_lora_loads_back(QwenImageEditPlusPipeline, tiny_edit, reference)
    linears = {n.replace(".", "_"): m.out_features for n, m in pipe.transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}
    kohya = load_file(str(reference / "output" / "ref_kohya.safetensors"))
    modules = {key.split(".")[0] for key in kohya}
    last = pipe.transformer.config.num_layers - 1
    assert len(modules) == 12 * (last + 1) - 4  # every targeted layer but the last block's text stream
    for module in modules:
        path = module.removeprefix("lora_unet_")
        assert module.startswith("lora_unet_transformer_blocks_") and path in linears
        assert kohya[f"{module}.lora_up.weight"].shape[0] == linears[path]
        assert kohya[f"{module}.alpha"].item() == 2.0
