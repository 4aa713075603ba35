"""Flow-matching maths (SD3/FLUX) against hand computations and diffusers' own schedulers; FLUX latent packing;
the FLUX kohya/ComfyUI export against a hand-merged LoRA and diffusers' kohya conversion. CPU, seconds."""

import math

import pytest
import torch

from trainer.families.components import flow_matching as fm


def test_noisy_input_and_velocity_target_match_a_hand_computation():
    x0 = torch.tensor([[[[1.0, -2.0]]], [[[0.5, 4.0]]], [[[3.0, 3.0]]]])  # (3, 1, 1, 2)
    noise = torch.tensor([[[[0.0, 2.0]]], [[[-1.0, 1.0]]], [[[2.0, -3.0]]]])
    sigmas = torch.tensor([0.0, 0.25, 1.0])
    noisy, target = fm.noisy_and_target(x0, noise, sigmas)
    # by hand: (1 - s) * x0 + s * noise, and noise - x0
    expected_noisy = torch.tensor([[[[1.0, -2.0]]], [[[0.75 * 0.5 - 0.25, 0.75 * 4 + 0.25]]], [[[2.0, -3.0]]]])
    expected_target = torch.tensor([[[[-1.0, 4.0]]], [[[-1.5, -3.0]]], [[[-1.0, -6.0]]]])
    torch.testing.assert_close(noisy, expected_noisy)
    torch.testing.assert_close(target, expected_target)


def test_noisy_input_matches_diffusers_flow_match_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    x0, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
    timesteps = scheduler.timesteps[torch.tensor([100, 700])]
    sigmas = timesteps / 1000  # FlowMatchEuler: timestep = sigma * 1000
    expected = torch.cat([scheduler.scale_noise(x0[i:i + 1], timesteps[i:i + 1], noise[i:i + 1]) for i in range(2)])
    torch.testing.assert_close(fm.noisy_and_target(x0, noise, sigmas)[0], expected)


def test_shift_matches_the_scheduler_and_flux_resolution_shift_matches_its_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    unshifted = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(fm.shift_sigma(unshifted, 3.0), scheduler.timesteps / 1000, rtol=1e-5, atol=1e-6)
    assert fm.shift_sigma(0.5, 3.0) == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    for seq_len in (256, 1024, 4096):
        assert fm.resolution_shift(seq_len) == pytest.approx(math.exp(calculate_shift(seq_len)))
    assert fm.resolution_shift(4096) == pytest.approx(math.exp(1.15))  # 1024 px FLUX
    assert fm.resolution_shift(256) == pytest.approx(math.exp(0.5))  # 256 px
    # exp(mu)-shifting is FLUX's time_shift(mu, 1, t) = e^mu / (e^mu + 1/t - 1)
    mu, t = 0.8, 0.3
    assert fm.shift_sigma(t, math.exp(mu)) == pytest.approx(math.exp(mu) / (math.exp(mu) + 1 / t - 1))


def test_logit_normal_and_shift_statistics():
    gen = torch.Generator().manual_seed(0)
    u = torch.tensor([fm.draw_u(gen, scheme="logit_normal", logit_mean=0.5, logit_std=0.8) for _ in range(4000)])
    logits = torch.log(u / (1 - u))
    assert logits.mean().item() == pytest.approx(0.5, abs=0.05)
    assert logits.std().item() == pytest.approx(0.8, abs=0.05)
    uniform = torch.tensor([fm.draw_u(gen, scheme="uniform") for _ in range(4000)])
    assert uniform.min() >= 0 and uniform.max() < 1 and uniform.mean().item() == pytest.approx(0.5, abs=0.03)
    # a shift > 1 moves mass towards noise: median sigma of logit-normal(0, 1) is shift_sigma(0.5)
    u0 = torch.sigmoid(torch.randn(4000, generator=gen))
    for shift in (1.0, 3.0, math.exp(1.15)):
        median = fm.shift_sigma(u0, shift).median().item()
        assert median == pytest.approx(shift / (1 + shift), abs=0.03)
    with pytest.raises(ValueError):
        fm.draw_u(gen, scheme="cosine")


def test_draws_are_a_function_of_the_seed():
    def draw(seed):
        return fm.draw_sample(torch.Generator().manual_seed(seed), (4, 2, 2), scheme="logit_normal",
                              logit_mean=0.0, logit_std=1.0, shift=3.0)

    a, b, c = draw(1), draw(1), draw(2)
    assert a[1] == b[1] and torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert a[1] != c[1] and 0 < a[1] < 1


def test_loss_weighting():
    sigmas = torch.tensor([0.5, 0.25])
    pred, target = torch.zeros(2, 3), torch.ones(2, 3)
    torch.testing.assert_close(fm.per_sample_loss(pred, target, sigmas, "none"), torch.ones(2))
    torch.testing.assert_close(fm.per_sample_loss(pred, target, sigmas, "sigma_sqrt"), torch.tensor([4.0, 16.0]))
    cosmap = 2 / (math.pi * (1 - 2 * 0.5 + 2 * 0.25))
    assert fm.loss_weight(sigmas, "cosmap")[0].item() == pytest.approx(cosmap)


def test_flux_latent_packing_round_trip_matches_the_pipeline():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 8, 12)
    packed = fm.pack_latents(latents)
    assert packed.shape == (2, 4 * 6, 64)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 12))
    torch.testing.assert_close(fm.unpack_latents(packed, 8, 12), latents)
    ids = FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32)
    torch.testing.assert_close(fm.latent_image_ids(8, 12), ids)


# ---- FLUX kohya export ----------------------------------------------------------------------------------------
def _tiny_flux_with_lora(targets):
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    model.add_adapter(LoraConfig(r=2, lora_alpha=3, init_lora_weights="gaussian", target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def _deltas(model):
    """{module path: scaling * B @ A} of every LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {n: m.scaling["default"] * m.lora_B["default"].weight @ m.lora_A["default"].weight
            for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _kohya_of(model):
    from trainer.families.flow.kohya_flux import flux_to_kohya
    from trainer.families.components.lora_files import _lora_modules, _peft_state

    adapter, modules = _lora_modules(model)
    out_features = {n: m.out_features for n, m in model.named_modules() if isinstance(getattr(m, "out_features", None), int)}
    return flux_to_kohya(_peft_state(model, adapter), {p: a for p, (_, a) in modules.items()}, out_features)


def test_flux_kohya_keys_fuse_qkv_and_reproduce_every_update():
    targets = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
               "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.ff.net.2",
               "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v",
               "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out"]
    model = _tiny_flux_with_lora(targets)
    kohya = _kohya_of(model)
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in kohya}
    assert names == {"lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_attn_qkv",
                     "lora_unet_double_blocks_0_img_mlp_2", "lora_unet_single_blocks_0_linear1",
                     "lora_unet_single_blocks_0_linear2"}
    assert all(f"{n}.alpha" in kohya for n in names)
    deltas = _deltas(model)
    dim = 16

    def merged(name):  # what ComfyUI adds to the fused BFL weight
        down, up, alpha = kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"], kohya[f"{name}.alpha"]
        return alpha / down.shape[0] * up @ down

    zero = torch.zeros(dim, dim)
    qkv = merged("lora_unet_double_blocks_0_img_attn_qkv")
    torch.testing.assert_close(qkv, torch.cat([deltas[f"transformer_blocks.0.attn.to_{x}"] for x in "qkv"]))
    txt = merged("lora_unet_double_blocks_0_txt_attn_qkv")  # only k was trained: q and v rows stay zero
    torch.testing.assert_close(txt, torch.cat([zero, deltas["transformer_blocks.0.attn.add_k_proj"], zero]))
    linear1 = merged("lora_unet_single_blocks_0_linear1")
    s = "single_transformer_blocks.0."
    torch.testing.assert_close(linear1, torch.cat([deltas[s + "attn.to_q"], zero, deltas[s + "attn.to_v"],
                                                   deltas[s + "proj_mlp"]]))
    torch.testing.assert_close(merged("lora_unet_single_blocks_0_linear2"), deltas[s + "proj_out"])
    torch.testing.assert_close(merged("lora_unet_double_blocks_0_img_mlp_2"), deltas["transformer_blocks.0.ff.net.2"])


def test_flux_kohya_double_blocks_convert_back_exactly_through_diffusers():
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.to_out.0", "ff_context.net.0.proj"]
    model = _tiny_flux_with_lora([f"transformer_blocks.0.{t}" for t in targets])
    back = _convert_kohya_flux_lora_to_diffusers(dict(_kohya_of(model)))
    deltas = _deltas(model)
    # diffusers folds alpha / rank into the factors and loads them at scale 1
    for path, delta in deltas.items():
        a, b = back[f"transformer.{path}.lora_A.weight"], back[f"transformer.{path}.lora_B.weight"]
        torch.testing.assert_close(b @ a, delta, rtol=1e-5, atol=1e-6)
    # the untrained k/v parts of txt_attn_qkv come back as zero updates, nothing else appears
    extra = {k.rsplit(".lora_", 1)[0].removeprefix("transformer.") for k in back} - set(deltas)
    assert extra == {"transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.attn.add_v_proj"}
    for path in extra:
        assert back[f"transformer.{path}.lora_B.weight"].abs().max() == 0


def _flux_family(guidance_embeds: bool, *overrides):
    from types import SimpleNamespace

    from diffusers import FluxTransformer2DModel

    from trainer.core.config import load_config
    from trainer.families.flow.flux import FluxFamily

    config = load_config(None, ["model.family=flux", *overrides], check_paths=False)
    family = FluxFamily(SimpleNamespace(config=config))  # no load(): the trainer gets its model parts here
    flow = family.flow
    flow.transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                              attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                              pooled_projection_dim=16, guidance_embeds=guidance_embeds,
                                              axes_dims_rope=(2, 2, 4))
    if guidance_embeds:  # FLUX.1-dev's scheduler config
        flow.scheduler_config = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                                 "base_image_seq_len": 256, "max_image_seq_len": 4096}
    else:  # schnell's
        flow.scheduler_config = {"shift": 1.0, "use_dynamic_shifting": False}
    return family


def test_flux_dev_and_schnell_settings():
    dev, schnell = _flux_family(True), _flux_family(False)
    assert dev.shift((16, 128, 128)) == pytest.approx(math.exp(1.15))  # 1024 px: 64 x 64 = 4096 tokens
    assert dev.shift((16, 32, 32)) == pytest.approx(math.exp(0.5))  # 256 px: 256 tokens
    assert schnell.shift((16, 128, 128)) == 1.0
    assert _flux_family(True, "flow.shift=2.0").shift((16, 128, 128)) == 2.0
    assert (dev.max_sequence_length(), schnell.max_sequence_length()) == (512, 256)


def test_flux_lora_block_selection():
    def paths(*overrides):
        return _flux_family(True, *overrides).flow.lora_target_paths()

    everything = paths()
    assert "transformer_blocks.0.attn.add_q_proj" in everything and "single_transformer_blocks.0.proj_mlp" in everything
    assert "proj_out" not in everything  # the final layer is never hit by the single blocks' proj_out
    assert all(p.startswith("transformer_blocks.") for p in paths("flow.lora_blocks=double"))
    assert all(p.startswith("single_transformer_blocks.") for p in paths("flow.lora_blocks=single"))
    assert paths("flow.lora_targets=[attn.to_q]") == ["transformer_blocks.0.attn.to_q",
                                                      "single_transformer_blocks.0.attn.to_q"]
