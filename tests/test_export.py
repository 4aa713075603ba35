"""Export: LoRA files that diffusers and the kohya ecosystem load to the exact trained model, and SD 1.x single files.

The LoRA tests train nothing: they add peft LoRA layers to the tiny SD model, set random non-zero lora_B weights
(what training produces) and check that a fresh pipeline loading the exported files computes the same UNet
output as the model that was "trained", through diffusers' own loaders for both formats.
"""

import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trainer.errors import UserError
from trainer.families.components.kohya import kohya_metadata, to_kohya
from trainer.families.components.ldm_checkpoint import save_single_file, to_ldm_state_dict
from trainer.families.components.lora_files import DIFFUSERS_WEIGHT_NAME, save_lora

UNET_TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]
TE_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj"]
# rank == alpha; alpha > rank with a different rank; rsLoRA (scale alpha/sqrt(rank)): every way scaling can go.
CASES = [dict(rank=4, alpha=4), dict(rank=2, alpha=8), dict(rank=4, alpha=8, rslora=True)]
KOHYA_KEY = re.compile(r"^(lora_unet|lora_te)_[a-z0-9_]+\.(lora_down\.weight|lora_up\.weight|alpha)$")


@pytest.fixture(scope="module")
def tiny_sd(tiny_sd_path):  # the session's demo model: make_tiny_sd with its defaults
    return tiny_sd_path


def _pipe(tiny_sd):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _trained(tiny_sd, rank, alpha, rslora=False):
    """A pipeline whose UNet and text encoder carry peft LoRA layers with non-zero (as if trained) weights."""
    from peft import LoraConfig, inject_adapter_in_model

    pipe = _pipe(tiny_sd)
    config = dict(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", use_rslora=rslora)
    pipe.unet.add_adapter(LoraConfig(target_modules=UNET_TARGETS, **config))
    # Not text_encoder.add_adapter(): transformers 5.24 refuses it with peft < 0.22 (0.21.2 is installed).
    inject_adapter_in_model(LoraConfig(target_modules=TE_TARGETS, **config), pipe.text_encoder)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for model in (pipe.unet, pipe.text_encoder):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return pipe


@torch.no_grad()
def _output(pipe):
    """The UNet's prediction for a fixed latent, timestep and prompt, through the (possibly LoRA'd) text encoder."""
    ids = pipe.tokenizer(
        "a photo of sks dog", padding="max_length", max_length=pipe.tokenizer.model_max_length, return_tensors="pt"
    ).input_ids
    latents = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    return pipe.unet(latents, torch.tensor([500]), pipe.text_encoder(ids)[0]).sample


def _assert_same(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def exported(request, tiny_sd, tmp_path_factory):
    case = request.param
    pipe = _trained(tiny_sd, **case)
    out_dir = tmp_path_factory.mktemp("lora")
    meta = {"name": "sks dog", "steps": 100, "comment": "test run", "base_model": "tiny-sd", "seed": 7}
    paths = save_lora(out_dir, pipe.unet, pipe.text_encoder, rank=case["rank"], alpha=case["alpha"], metadata=meta)
    return dict(case=case, pipe=pipe, paths=paths, out_dir=out_dir, expected=_output(pipe))


def test_diffusers_file_reproduces_trained_model(exported, tiny_sd):
    assert exported["paths"]["diffusers"] == exported["out_dir"] / DIFFUSERS_WEIGHT_NAME
    fresh = _pipe(tiny_sd)
    base = _output(fresh)
    fresh.load_lora_weights(exported["out_dir"])
    _assert_same(_output(fresh), exported["expected"])
    assert (base - exported["expected"]).abs().max() > 1e-3  # the LoRA does change the model


def test_kohya_file_reproduces_trained_model_through_diffusers_converter(exported, tiny_sd):
    """diffusers' own kohya -> diffusers conversion reads our names and alphas to the same model."""
    fresh = _pipe(tiny_sd)
    fresh.load_lora_weights(str(exported["paths"]["kohya"]))
    _assert_same(_output(fresh), exported["expected"])


def test_kohya_file_layout_and_metadata(exported):
    case, path = exported["case"], exported["paths"]["kohya"]
    assert path.name == "sks_dog_kohya.safetensors"
    tensors = load_file(path)
    assert all(KOHYA_KEY.match(k) for k in tensors), [k for k in tensors if not KOHYA_KEY.match(k)]

    modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in tensors}
    assert len(tensors) == 3 * len(modules)
    unet = {m for m in modules if m.startswith("lora_unet_")}
    te = {m for m in modules if m.startswith("lora_te_")}
    lora_layers = lambda model: [n for n, m in model.named_modules() if hasattr(m, "lora_A") and m.r]  # noqa: E731
    assert len(unet) == len(lora_layers(exported["pipe"].unet))
    assert len(te) == len(lora_layers(exported["pipe"].text_encoder)) == 2 * 4  # 2 layers x q/k/v/out
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in unet
    assert "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn2_to_out_0" in unet
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in te

    rank, alpha = case["rank"], case["alpha"]
    # kohya applies alpha/rank; rsLoRA's alpha/sqrt(rank) is expressed as the equivalent kohya alpha.
    kohya_alpha = alpha * rank**0.5 if case.get("rslora") else alpha
    for module in modules:
        assert tensors[f"{module}.alpha"].shape == ()
        assert tensors[f"{module}.alpha"].item() == pytest.approx(kohya_alpha)
        assert tensors[f"{module}.lora_down.weight"].shape[0] == rank
        assert tensors[f"{module}.lora_up.weight"].shape[1] == rank
        assert tensors[f"{module}.lora_up.weight"].abs().max() > 0

    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["ss_network_module"] == "networks.lora"
    assert meta["ss_network_dim"] == str(rank)
    assert float(meta["ss_network_alpha"]) == alpha
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_v2"] == "False"
    assert meta["ss_output_name"] == "sks dog" and meta["ss_steps"] == "100"
    assert meta["ss_training_comment"] == "test run" and meta["ss_sd_model_name"] == "tiny-sd"
    assert meta["ss_seed"] == "7"  # unknown keys are kept, as ss_<key>
    assert meta["modelspec.sai_model_spec"] == "1.0.0"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert meta["modelspec.title"] == "sks dog" and meta["modelspec.implementation"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", meta["modelspec.date"])


def test_without_its_metadata_diffusers_would_load_the_wrong_strength(exported, tiny_sd, tmp_path):
    """Why the adapter metadata is written: diffusers-format files have no alpha tensors, and without the
    lora_adapter_metadata header diffusers assumes alpha == rank."""
    case = exported["case"]
    # alpha == rank: the assumption happens to hold, so the same file loads right without its metadata
    wrong_strength = case["alpha"] != case["rank"] or case.get("rslora")
    save_file(load_file(exported["paths"]["diffusers"]), tmp_path / DIFFUSERS_WEIGHT_NAME, metadata={"format": "pt"})
    fresh = _pipe(tiny_sd)
    fresh.load_lora_weights(tmp_path)
    difference = (_output(fresh) - exported["expected"]).abs().max()
    assert difference > 1e-4 if wrong_strength else difference < 1e-6


def test_unwraps_compile_and_ddp(tiny_sd, tmp_path):
    import torch.distributed as dist

    pipe = _trained(tiny_sd, rank=2, alpha=4)
    expected = _output(pipe)
    assert not dist.is_initialized(), "no other test may leave a process group behind"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        wrapped = torch.compile(torch.nn.parallel.DistributedDataParallel(pipe.unet))  # compiled lazily: no cost
        save_lora(tmp_path, wrapped, torch.compile(pipe.text_encoder), rank=2, alpha=4, metadata={})
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "lora_kohya.safetensors").is_file()
    fresh = _pipe(tiny_sd)
    fresh.load_lora_weights(tmp_path)
    _assert_same(_output(fresh), expected)


def test_unet_only_and_mismatched_settings(tiny_sd, tmp_path):
    pipe = _trained(tiny_sd, rank=2, alpha=4)
    with pytest.raises(ValueError, match="rank 2 and alpha 4"):
        save_lora(tmp_path, pipe.unet, rank=4, alpha=4, metadata={})
    paths = save_lora(tmp_path, pipe.unet, rank=2, alpha=4, metadata={"name": "unet only"})
    keys = load_file(paths["kohya"]).keys()
    assert keys and all(k.startswith("lora_unet_") for k in keys)
    with safe_open(paths["kohya"], "pt") as f:
        assert f.metadata()["ss_network_train_unet_only"] == "True"
    with pytest.raises(ValueError, match="no LoRA layers"):
        save_lora(tmp_path, _pipe(tiny_sd).unet, rank=2, alpha=4, metadata={})


def test_to_kohya_naming_prefixes_and_alphas():
    down, up = torch.ones(2, 8), torch.ones(8, 2)
    peft_unet = {"mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.lora_A.weight": down,
                 "mid_block.attentions.0.transformer_blocks.0.attn2.to_out.0.lora_B.weight": up}  # fmt: skip
    # A diffusers-format text-encoder dict from a flattened transformers-5 CLIP: "text_model." is restored.
    diffusers_te = {"encoder.layers.3.self_attn.k_proj.lora_linear_layer.down.weight": down,
                    "encoder.layers.3.self_attn.k_proj.lora_linear_layer.up.weight": up}  # fmt: skip
    out = to_kohya(peft_unet, diffusers_te, alpha=1.0)
    assert sorted(out) == [
        "lora_te_text_model_encoder_layers_3_self_attn_k_proj.alpha",
        "lora_te_text_model_encoder_layers_3_self_attn_k_proj.lora_down.weight",
        "lora_te_text_model_encoder_layers_3_self_attn_k_proj.lora_up.weight",
        "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.alpha",
        "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.lora_down.weight",
        "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.lora_up.weight",
    ]
    assert out["lora_te_text_model_encoder_layers_3_self_attn_k_proj.alpha"].dtype == torch.float32
    # SDXL's second text encoder is the same call with its prefix; per-module alphas by kohya name.
    te2 = to_kohya(None, diffusers_te, alpha={"lora_te2_text_model_encoder_layers_3_self_attn_k_proj": 3.0},
                   text_encoder_prefix="lora_te2")  # fmt: skip
    assert te2["lora_te2_text_model_encoder_layers_3_self_attn_k_proj.alpha"].item() == 3.0

    with pytest.raises(ValueError, match="only its down weight"):
        to_kohya({"a.lora_A.weight": down}, None, alpha=1)
    with pytest.raises(ValueError, match="DoRA"):
        to_kohya({"a.lora_magnitude_vector": down}, None, alpha=1)


def test_kohya_metadata_for_sd2_v():
    meta = kohya_metadata(rank=8, alpha=4, name="x", base_model_version="sd_v2", prediction_type="v_prediction")
    assert meta["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert meta["ss_v2"] == "True" and meta["ss_v_parameterization"] == "True"
    assert meta["modelspec.resolution"] == "768x768" and meta["ss_network_alpha"] == "4.0"


# ---------------------------------------------------------------------------------------------------------------
# Single-file (LDM) checkpoints


def test_single_file_round_trips_through_diffusers_from_single_file(tiny_sd, tmp_path):
    from diffusers import StableDiffusionPipeline

    original = _pipe(tiny_sd)
    path = save_single_file(tiny_sd, tmp_path / "model.safetensors", dtype=torch.float32)
    loaded = StableDiffusionPipeline.from_single_file(str(path), config=str(tiny_sd), local_files_only=True)
    for name in ("unet", "vae", "text_encoder"):
        want, got = getattr(original, name).state_dict(), getattr(loaded, name).state_dict()
        assert set(got) == set(want), name
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"{name}.{key}"


def test_single_file_layout_fp16(tiny_sd, tmp_path):
    path = save_single_file(_pipe(tiny_sd), tmp_path / "model.safetensors")  # a pipeline object, default fp16
    tensors = load_file(path)
    prefixes = ("model.diffusion_model.", "first_stage_model.", "cond_stage_model.transformer.text_model.")
    assert all(k.startswith(prefixes) for k in tensors)
    assert tensors["cond_stage_model.transformer.text_model.embeddings.position_ids"].dtype == torch.int64
    assert {v.dtype for k, v in tensors.items() if not k.endswith("position_ids")} == {torch.float16}
    assert tensors["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4  # linear -> 1x1 conv
    with safe_open(path, "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-v1"


def _meta_sd1(hidden_act="quick_gelu", hidden_size=768):
    """Full-size SD 1.5-shaped models on the meta device: real layouts, no memory, no time."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        unet = UNet2DConditionModel(cross_attention_dim=768, attention_head_dim=8, sample_size=64)
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        )  # fmt: skip
        te = CLIPTextModel(CLIPTextConfig(
            hidden_size=hidden_size, num_attention_heads=hidden_size // 64, intermediate_size=3072,
            num_hidden_layers=12, vocab_size=49408, hidden_act=hidden_act,
        ))  # fmt: skip
    return unet, vae, te


def test_full_size_sd15_layout_matches_the_released_checkpoint():
    """v1-5-pruned(-emaonly) has 1131 tensors: 686 UNet, 248 VAE, 197 text encoder. diffusers' own
    LDM -> diffusers converters must invert our mapping to exactly the original names and shapes."""
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint

    unet, vae, te = _meta_sd1()
    state = to_ldm_state_dict(unet, vae, te)
    count = lambda prefix: sum(k.startswith(prefix) for k in state)  # noqa: E731
    split = (len(state), count("model."), count("first_stage_model."), count("cond_stage_model."))
    assert split == (1131, 686, 248, 197)
    for key in ("model.diffusion_model.output_blocks.11.0.skip_connection.weight",  # diffusers' SD1 detection key
                "model.diffusion_model.output_blocks.2.1.conv.weight",  # upsampler of a level without attention
                "model.diffusion_model.output_blocks.5.2.conv.weight",  # ... and of one with attention
                "model.diffusion_model.input_blocks.3.0.op.weight",
                "first_stage_model.decoder.up.3.upsample.conv.weight",
                "cond_stage_model.transformer.text_model.embeddings.position_embedding.weight"):  # fmt: skip
        assert key in state, key
    for back, model in ((convert_ldm_unet_checkpoint(state, dict(unet.config)), unet),
                        (convert_ldm_vae_checkpoint(state, dict(vae.config)), vae)):  # fmt: skip
        want = model.state_dict()
        assert set(back) == set(want)
        assert all(back[k].shape == v.shape for k, v in want.items())


def test_single_file_refuses_sd2_and_unfused_lora(tiny_sd, tmp_path):
    unet, vae, te = _meta_sd1(hidden_act="gelu", hidden_size=1024)
    with pytest.raises(UserError, match="SD 2.x"):
        to_ldm_state_dict(unet, vae, te)
    pipe = _trained(tiny_sd, rank=2, alpha=2)
    with pytest.raises(ValueError, match="fuse"):
        save_single_file(pipe, tmp_path / "x.safetensors")
