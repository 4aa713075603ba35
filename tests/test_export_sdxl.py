"""SDXL single-file (SGM layout) export: what A1111 / ComfyUI / Forge load, checked through diffusers' own reader.

The tiny SDXL model (trainer.families.sdxl.demo) is written as one file, loaded back with
`StableDiffusionXLPipeline.from_single_file` (offline, the folder as config) and compared tensor by tensor and
image by image. Full-size SDXL layouts are checked on the meta device (no memory, no weights).
"""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.errors import UserError
from trainer.families.sdxl.checkpoint import open_clip_to_ldm, save_sdxl_single_file, to_sdxl_state_dict

COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")
PROMPT = "a photo of a red circle"


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory):
    """The tiny SDXL model with text encoders of different widths (32 and 48, as SDXL's are 768 and 1280).

    diffusers' single-file reader tells the two text encoders apart by width: with the demo's equal widths it
    loads text encoder 1's weights into text encoder 2. Real SDXL never hits that; the test must not either.
    """
    import trainer.families.sdxl.demo as demo

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo, "TE_HIDDEN", (32, 48))
        return demo.make_tiny_sdxl(tmp_path_factory.mktemp("tiny-sdxl") / "model")


def _pipe(folder):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def _image(pipe):
    generator = torch.Generator().manual_seed(3)
    return pipe(PROMPT, num_inference_steps=2, height=64, width=64, generator=generator, output_type="pt").images


def test_single_file_round_trips_through_diffusers_from_single_file(tiny_sdxl, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    original = _pipe(tiny_sdxl)
    path = save_sdxl_single_file(tiny_sdxl, tmp_path / "model.safetensors", dtype=torch.float32)
    loaded = StableDiffusionXLPipeline.from_single_file(str(path), config=str(tiny_sdxl), local_files_only=True)
    loaded.set_progress_bar_config(disable=True)
    for name in COMPONENTS:
        want, got = getattr(original, name).state_dict(), getattr(loaded, name).state_dict()
        assert set(got) == set(want), name
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), f"{name}.{key}"
    # Both loaders leave the weights as views into the files' buffers, at whatever alignment the file layout gives,
    # and CPU kernels vectorise differently by alignment (images ~2e-6 apart). In fresh (aligned) memory the same
    # weights give the bit-identical image.
    for pipe in (original, loaded):
        for name in COMPONENTS:
            for tensor in (*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()):
                tensor.data = tensor.data.clone()
    expected = _image(original)
    assert expected.shape == (1, 3, 64, 64)
    torch.testing.assert_close(_image(loaded), expected, rtol=0, atol=0)


def test_single_file_layout_fp16_from_a_pipeline_object(tiny_sdxl, tmp_path):
    pipe = _pipe(tiny_sdxl)
    path = save_sdxl_single_file(pipe, tmp_path / "model.safetensors")  # default fp16
    tensors = load_file(path)
    prefixes = ("model.diffusion_model.", "first_stage_model.", "conditioner.embedders.0.transformer.text_model.",
                "conditioner.embedders.1.model.")  # fmt: skip
    assert all(k.startswith(prefixes) for k in tensors), [k for k in tensors if not k.startswith(prefixes)]
    assert tensors["conditioner.embedders.0.transformer.text_model.embeddings.position_ids"].dtype == torch.int64
    assert {v.dtype for k, v in tensors.items() if not k.endswith("position_ids")} == {torch.float16}
    # text encoder 2: q/k/v fused (3 x 48 rows), projection stored transposed (hidden 48 x projection 32)
    te2 = "conditioner.embedders.1.model."
    assert tensors[f"{te2}transformer.resblocks.1.attn.in_proj_weight"].shape == (144, 48)
    projection = pipe.text_encoder_2.text_projection.weight
    assert torch.equal(tensors[f"{te2}text_projection"], projection.T.half())
    assert torch.equal(tensors["model.diffusion_model.label_emb.0.2.bias"],
                       pipe.unet.add_embedding.linear_2.bias.half())  # fmt: skip
    assert "model.diffusion_model.input_blocks.3.1.transformer_blocks.1.attn2.to_k.weight" in tensors  # depth 2
    with safe_open(path, "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert not list(tmp_path.glob("*.partial"))


def _meta_sdxl():
    """Full-size SDXL base-shaped models on the meta device: real layouts, no memory, no time."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with torch.device("meta"):
        unet = UNet2DConditionModel(
            sample_size=128, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(320, 640, 1280), layers_per_block=2, attention_head_dim=(5, 10, 20),
            transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
        )  # fmt: skip
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        )  # fmt: skip
        te = CLIPTextModel(CLIPTextConfig(
            hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=12,
            vocab_size=49408, hidden_act="quick_gelu",
        ))  # fmt: skip
        te2 = CLIPTextModelWithProjection(CLIPTextConfig(
            hidden_size=1280, num_attention_heads=20, intermediate_size=5120, num_hidden_layers=32,
            vocab_size=49408, hidden_act="gelu", projection_dim=1280,
        ))  # fmt: skip
    return unet, vae, te, te2


def test_full_size_sdxl_layout_is_what_diffusers_reads_back():
    """1680 UNet, 248 VAE, 197 text encoder 1 (position_ids included) and 389 text encoder 2 tensors. The
    released sd_xl_base_1.0 also carries `conditioner.embedders.1.model.logit_scale` (OpenCLIP's contrastive
    temperature: unused for generation, not in diffusers' model, so not written). diffusers' SGM -> diffusers
    converters must invert our mapping to exactly the same names and shapes."""
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
        infer_diffusers_model_type,
    )

    unet, vae, te, te2 = _meta_sdxl()
    state = to_sdxl_state_dict(unet, vae, te, te2)
    count = lambda prefix: sum(k.startswith(prefix) for k in state)
    split = (count("model."), count("first_stage_model."), count("conditioner.embedders.0."),
             count("conditioner.embedders.1."))  # fmt: skip
    assert split == (1680, 248, 197, 389)
    assert infer_diffusers_model_type(state) == "xl_base"
    for key in ("model.diffusion_model.label_emb.0.0.weight",
                "model.diffusion_model.input_blocks.3.0.op.weight",
                "model.diffusion_model.input_blocks.8.1.transformer_blocks.9.attn2.to_k.weight",
                "model.diffusion_model.middle_block.1.transformer_blocks.9.ff.net.2.weight",
                "model.diffusion_model.output_blocks.2.2.conv.weight",  # upsampler after an attention
                "model.diffusion_model.output_blocks.5.2.conv.weight",
                "model.diffusion_model.output_blocks.8.0.skip_connection.weight",
                "first_stage_model.decoder.up.3.upsample.conv.weight",
                "conditioner.embedders.0.transformer.text_model.encoder.layers.11.self_attn.q_proj.weight",
                "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight"):  # fmt: skip
        assert key in state, key
    assert state["conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight"].shape == (3840, 1280)
    backs = (
        (convert_ldm_unet_checkpoint(state, dict(unet.config)), unet),
        (convert_ldm_vae_checkpoint(state, dict(vae.config)), vae),
        (convert_ldm_clip_checkpoint(state, "conditioner.embedders.0.transformer."), te),
        (convert_open_clip_checkpoint(te2, state, prefix="conditioner.embedders.1.model."), te2),
    )
    for back, model in backs:
        want = model.state_dict()
        if model is te:  # transformers 5 flattens CLIPTextModel; diffusers strips `text_model.` the same way
            back = {k.removeprefix("text_model."): v for k, v in back.items()}
            want = {**want, "embeddings.position_ids": None}
        assert set(back) == set(want), type(model).__name__
        assert all(v is None or back[k].shape == v.shape for k, v in want.items())


def test_unknown_keys_raise_instead_of_being_written_under_a_wrong_name(tiny_sdxl):
    pipe = _pipe(tiny_sdxl)
    state = pipe.text_encoder_2.state_dict()
    with pytest.raises(UserError, match="second text encoder has weights the SDXL single-file layout has no place"):
        open_clip_to_ldm({**state, "text_model.encoder.layers.0.self_attn.extra.weight": torch.zeros(1)})
    del state["text_model.encoder.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(UserError, match="layer 1 lacks some of its q/k/v bias"):
        open_clip_to_ldm(state)

    pipe.unet.register_buffer("mystery", torch.zeros(1))
    with pytest.raises(UserError, match="UNet has weights the SDXL single-file layout has no place for: mystery"):
        to_sdxl_state_dict(pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)


def test_refuses_a_non_sdxl_unet_and_unfused_lora(tiny_sdxl, tmp_path):
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    pipe = _pipe(tiny_sdxl)
    config = {k: v for k, v in pipe.unet.config.items() if not k.startswith("_")}
    plain = UNet2DConditionModel(**{**config, "addition_embed_type": None})
    with pytest.raises(UserError, match="not an SDXL one"):
        to_sdxl_state_dict(plain, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)
    pipe.unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    with pytest.raises(ValueError, match="fuse"):
        save_sdxl_single_file(pipe, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


def _outputs_of_a_full_run(tiny_sdxl, tmp_path, *overrides):
    """save_sdxl_outputs on a stand-in family that has what it reads: the config, the models, a context."""
    from types import SimpleNamespace

    from trainer.core.config import load_config
    from trainer.families.sdxl.outputs import save_sdxl_outputs

    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"model.path={tiny_sdxl}", "model.family=sdxl", "method=full", "name=my-sdxl",
                             f"data.path={tmp_path / 'data'}", *overrides])  # fmt: skip
    pipe = _pipe(tiny_sdxl)
    ctx = SimpleNamespace(unwrap=lambda m: m, device=torch.device("cpu"))
    family = SimpleNamespace(cfg=cfg, ctx=ctx, text_encoder=pipe.text_encoder, text_embeddings=None, ema=None,
                             prediction_type="epsilon", train_text_encoder=False, pipeline=lambda: pipe)  # fmt: skip
    return pipe, save_sdxl_outputs(family, tmp_path / "output", step=3)


def test_a_full_fine_tune_writes_the_single_file_by_default(tiny_sdxl, tmp_path):
    from diffusers import StableDiffusionXLPipeline

    pipe, outputs = _outputs_of_a_full_run(tiny_sdxl, tmp_path)
    assert outputs == [str(tmp_path / "output" / "diffusers"), str(tmp_path / "output" / "my-sdxl.safetensors")]
    assert {v.dtype for k, v in load_file(outputs[1]).items() if not k.endswith("position_ids")} == {torch.float16}
    loaded = StableDiffusionXLPipeline.from_single_file(outputs[1], config=outputs[0], local_files_only=True)
    for name in COMPONENTS:  # the trained weights, rounded to fp16 (diffusers loads them back as fp32)
        want, got = getattr(pipe, name).state_dict(), getattr(loaded, name).state_dict()
        assert set(got) == set(want), name
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor.half().to(got[key].dtype)), f"{name}.{key}"

    _, outputs = _outputs_of_a_full_run(tiny_sdxl, tmp_path / "off", "full.save_single_file=false")
    assert outputs == [str(tmp_path / "off" / "output" / "diffusers")]
