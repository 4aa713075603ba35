"""FLUX.1 and SD3 single files in the original published layouts, checked through diffusers' own readers.

- FLUX: a tiny transformer written in Black Forest Labs' layout loads back through
  `FluxTransformer2DModel.from_single_file` tensor for tensor (dev and schnell), and the full-size FLUX.1 key set
  is exactly what diffusers' converter consumes (on the meta device: no memory, no weights).
- SD3: a tiny pipeline written in Stability's layout (MMDiT, VAE, CLIP-L, CLIP-G, T5) loads back through
  `StableDiffusion3Pipeline.from_single_file` tensor for tensor; SD3.5 Medium's second attention through
  `SD3Transformer2DModel.from_single_file`; full-size SD3 / 3.5 Medium / 3.5 Large MMDiT layouts on the meta
  device through diffusers' unmodified converter.
- A full fine-tune's outputs (`save_outputs` on a stand-in family) hold `<name>.safetensors` beside `diffusers/`,
  made from the unwrapped (under FSDP: gathered) weights, the EMA ones when kept.
"""

import types
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from trainer.errors import UserError
from trainer.families.flow.flux_checkpoint import save_flux_single_file, to_flux_state_dict
from trainer.families.components.ldm_checkpoint import write_checkpoint
from trainer.families.flow.sd3_checkpoint import (
    COMPONENTS,
    mmdit_to_original,
    save_sd3_single_file,
    to_sd3_state_dict,
)

FLUX_TINY = {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 3, "attention_head_dim": 16,
             "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
             "axes_dims_rope": (4, 6, 6)}


def flux_converter(inner_dim: int, original=None):
    """diffusers' own `convert_flux_transformer_checkpoint_to_diffusers` (or `original`: Chroma's, which splits
    `linear1` with the same `inner_dim = 3072`), with its one hard-coded width generalised.

    diffusers 0.42.1 splits each single block's `linear1` into q, k, v and the MLP input with `inner_dim = 3072`
    written into the function (FLUX.1's 24 heads x 128), so a tiny model cannot go through `from_single_file`
    unchanged. This is the very same compiled function, every instruction and every other constant kept, with that
    one constant replaced by the tiny model's width; the test fails loudly if diffusers ever stops having exactly
    one 3072 there. The full-size key set is checked against the unmodified converter
    (test_flux_keys_are_exactly_the_ones_diffusers_converter_consumes).
    """
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    original = original or convert_flux_transformer_checkpoint_to_diffusers
    code = original.__code__
    assert [c for c in code.co_consts if type(c) is int].count(3072) == 1, f"diffusers' {original.__name__} changed"
    consts = tuple(inner_dim if type(c) is int and c == 3072 else c for c in code.co_consts)
    return types.FunctionType(code.replace(co_consts=consts), original.__globals__, original.__name__,
                              original.__defaults__, original.__closure__)


@pytest.fixture
def diffusers_reads_tiny_flux(monkeypatch):
    """`FluxTransformer2DModel.from_single_file` with the converter generalised to the tiny width (32)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"], "checkpoint_mapping_fn",
                        flux_converter(FLUX_TINY["num_attention_heads"] * FLUX_TINY["attention_head_dim"]))


def _tiny_flux(guidance: bool, seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(**FLUX_TINY, guidance_embeds=guidance)


def _assert_converter_reads_exactly(convert, state: dict, model, *, exact: bool = False) -> None:
    """diffusers' converters pop every key they read (a missing one raises KeyError): nothing may be left over
    (written for nothing), and what comes back is the model's own state dict (values too when `exact`; shapes
    only for models on the meta device)."""
    leftover = dict(state)
    back = convert(leftover)
    assert leftover == {}
    want = model.state_dict()
    if exact:
        _assert_same(back, want, "converted back")
    assert set(back) == set(want)
    assert all(back[k].shape == v.shape for k, v in want.items())


def _assert_same(got: dict, want: dict, what: str, cast=None):
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for key, tensor in want.items():
        expected = tensor if cast is None else tensor.to(cast).to(got[key].dtype)
        assert torch.equal(got[key], expected), f"{what}.{key}"


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux_round_trips_through_diffusers_from_single_file(guidance, diffusers_reads_tiny_flux, tmp_path):
    from diffusers import FluxTransformer2DModel

    transformer = _tiny_flux(guidance)
    transformer.save_pretrained(tmp_path / "model" / "transformer")  # the config diffusers reads
    path = save_flux_single_file(transformer, tmp_path / "flux.safetensors", dtype=torch.float32)
    loaded = FluxTransformer2DModel.from_single_file(str(path), config=str(tmp_path / "model"),
                                                     subfolder="transformer", local_files_only=True)
    _assert_same(loaded.state_dict(), transformer.state_dict(), "transformer")

    tensors = load_file(path)
    assert ("guidance_in.in_layer.weight" in tensors) is guidance
    assert "img_in.weight" in tensors and "double_blocks.1.txt_attn.qkv.bias" in tensors
    # the fused layouts, by hand: q/k/v rows in order, linear1 = q, k, v, MLP; final modulation (shift, scale)
    block = transformer.single_transformer_blocks[2]
    parts = (block.attn.to_q, block.attn.to_k, block.attn.to_v, block.proj_mlp)
    assert torch.equal(tensors["single_blocks.2.linear1.weight"], torch.cat([m.weight for m in parts]))
    attn = transformer.transformer_blocks[1].attn
    assert torch.equal(tensors["double_blocks.1.txt_attn.qkv.weight"],
                       torch.cat([attn.add_q_proj.weight, attn.add_k_proj.weight, attn.add_v_proj.weight]))
    scale, shift = transformer.norm_out.linear.weight.chunk(2)
    assert torch.equal(tensors["final_layer.adaLN_modulation.1.weight"], torch.cat([shift, scale]))
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.architecture"] == ("flux-1-dev" if guidance else "flux-1-schnell")
    assert meta["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert not list(tmp_path.glob("*.partial"))
    # from a diffusers folder (loaded in bf16, the default) the same tensors as cast from the module
    from_folder = load_file(save_flux_single_file(tmp_path / "model", tmp_path / "from-folder.safetensors"))
    _assert_same(from_folder, to_flux_state_dict(transformer, dtype=torch.bfloat16), "from folder")


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux_keys_are_exactly_the_ones_diffusers_converter_consumes(guidance):
    """The converter pops every key it reads (a missing one raises KeyError): what is left over was written for
    nothing. Tiny model through the generalised converter, full-size FLUX.1 on the meta device through the
    unmodified one (780 tensors for dev, 776 for schnell, as in flux1-dev / flux1-schnell.safetensors)."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_flux_transformer_checkpoint_to_diffusers,
        infer_diffusers_model_type,
    )

    tiny = _tiny_flux(guidance)
    _assert_converter_reads_exactly(flux_converter(32), to_flux_state_dict(tiny), tiny, exact=True)

    with torch.device("meta"):
        full = FluxTransformer2DModel(guidance_embeds=guidance)  # FLUX.1's defaults: 19 double, 38 single blocks
    state = to_flux_state_dict(full, dtype=torch.bfloat16)
    assert len(state) == (780 if guidance else 776)
    assert infer_diffusers_model_type(state) == ("flux-dev" if guidance else "flux-schnell")
    assert state["single_blocks.37.linear1.weight"].shape == (3 * 3072 + 12288, 3072)
    assert state["double_blocks.18.img_attn.qkv.weight"].shape == (9216, 3072)
    assert state["double_blocks.0.img_attn.norm.query_norm.scale"].shape == (128,)
    _assert_converter_reads_exactly(convert_flux_transformer_checkpoint_to_diffusers, state, full)


def test_flux_refuses_unknown_weights_and_unfused_lora(tmp_path):
    from peft import LoraConfig

    transformer = _tiny_flux(True)
    transformer.register_buffer("mystery", torch.zeros(1))
    with pytest.raises(UserError, match="FLUX transformer has weights the FLUX.1 single-file layout has no place"):
        to_flux_state_dict(transformer)
    transformer = _tiny_flux(True)
    transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    with pytest.raises(ValueError, match="fuse"):
        save_flux_single_file(transformer, tmp_path / "x.safetensors")
    assert not list(tmp_path.iterdir())


# ---- SD3 -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_sd3(tiny_sd3_path):
    """The demo's tiny SD3, shaped as the single-file layout assumes of real SD3/3.5 (trainer.families.flow.demo): CLIP-L's
    text projection the identity, CLIP-G wider than CLIP-L."""
    return tiny_sd3_path


def _sd3_pipe(folder):
    from diffusers import StableDiffusion3Pipeline

    return StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)


def test_sd3_single_file_round_trips_through_diffusers_from_single_file(tiny_sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    original = _sd3_pipe(tiny_sd3)
    path = save_sd3_single_file(tiny_sd3, tmp_path / "sd3.safetensors", dtype=torch.float32)
    loaded = StableDiffusion3Pipeline.from_single_file(str(path), config=str(tiny_sd3), local_files_only=True)
    for name in COMPONENTS:
        _assert_same(getattr(loaded, name).state_dict(), getattr(original, name).state_dict(), name)


def test_sd3_layout_bf16_from_a_pipeline_object(tiny_sd3, tmp_path):
    pipe = _sd3_pipe(tiny_sd3)
    path = save_sd3_single_file(pipe, tmp_path / "sd3.safetensors")  # default bf16
    tensors = load_file(path)
    prefixes = ("model.diffusion_model.", "first_stage_model.", "text_encoders.clip_l.transformer.text_model.",
                "text_encoders.clip_g.transformer.", "text_encoders.t5xxl.transformer.")  # fmt: skip
    assert all(k.startswith(prefixes) for k in tensors), [k for k in tensors if not k.startswith(prefixes)]
    assert {v.dtype for k, v in tensors.items() if not k.endswith("position_ids")} == {torch.bfloat16}
    mmdit = "model.diffusion_model."
    assert tensors[f"{mmdit}joint_blocks.0.x_block.attn.qkv.weight"].shape == (96, 32)
    assert f"{mmdit}joint_blocks.0.context_block.mlp.fc1.weight" in tensors
    assert f"{mmdit}joint_blocks.1.context_block.attn.proj.weight" not in tensors  # last block: text side pre-only
    scale, shift = pipe.transformer.transformer_blocks[1].norm1_context.linear.bias.chunk(2)
    assert torch.equal(tensors[f"{mmdit}joint_blocks.1.context_block.adaLN_modulation.1.bias"],
                       torch.cat([shift, scale]).bfloat16())
    assert "text_encoders.clip_l.transformer.text_projection.weight" not in tensors  # identity by convention
    assert torch.equal(tensors["text_encoders.clip_g.transformer.text_projection.weight"],
                       pipe.text_encoder_2.text_projection.weight.bfloat16())
    t5 = "text_encoders.t5xxl.transformer."
    assert torch.equal(tensors[f"{t5}shared.weight"], tensors[f"{t5}encoder.embed_tokens.weight"])
    with safe_open(path, "pt") as f:
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-3"


def test_sd35_medium_second_attention_round_trips(tmp_path):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=16, num_layers=3,
                                        attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                                        caption_projection_dim=32, pooled_projection_dim=32, out_channels=16,
                                        pos_embed_max_size=32, qk_norm="rms_norm", dual_attention_layers=(0, 1))
    transformer.save_pretrained(tmp_path / "model" / "transformer")
    state = {f"model.diffusion_model.{k}": v for k, v in mmdit_to_original(transformer).items()}
    assert "model.diffusion_model.joint_blocks.1.x_block.attn2.qkv.weight" in state
    path = write_checkpoint(state, tmp_path / "mmdit.safetensors", dtype=torch.float32, architecture="test")
    loaded = SD3Transformer2DModel.from_single_file(str(path), config=str(tmp_path / "model"),
                                                    subfolder="transformer", local_files_only=True)
    _assert_same(loaded.state_dict(), transformer.state_dict(), "transformer")


SD3_FULL_SIZE = {
    "sd3": {"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536, "pos_embed_max_size": 192},
    "sd35_medium": {"num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                    "pos_embed_max_size": 384, "qk_norm": "rms_norm", "dual_attention_layers": tuple(range(13))},
    "sd35_large": {"num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                   "pos_embed_max_size": 192, "qk_norm": "rms_norm"},
}


@pytest.mark.parametrize("model_type", list(SD3_FULL_SIZE))
def test_full_size_sd3_layout_is_what_diffusers_reads_back(model_type):
    """Full-size MMDiTs on the meta device through diffusers' unmodified converter: every key consumed (none
    left over, none missing), the same names and shapes back, and diffusers recognises the model."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_sd3_transformer_checkpoint_to_diffusers,
        infer_diffusers_model_type,
    )

    with torch.device("meta"):
        transformer = SD3Transformer2DModel(sample_size=128, attention_head_dim=64, joint_attention_dim=4096,
                                            pooled_projection_dim=2048, **SD3_FULL_SIZE[model_type])
    state = {f"model.diffusion_model.{k}": v for k, v in mmdit_to_original(transformer).items()}
    assert infer_diffusers_model_type(state) == model_type
    _assert_converter_reads_exactly(convert_sd3_transformer_checkpoint_to_diffusers, state, transformer)


def test_sd3_refuses_what_it_cannot_write_faithfully(tiny_sd3):
    pipe = _sd3_pipe(tiny_sd3)
    models = {name: getattr(pipe, name) for name in COMPONENTS}
    with torch.no_grad():
        pipe.text_encoder.text_projection.weight.mul_(2)
    with pytest.raises(UserError, match="CLIP-L.*not the identity"):
        to_sd3_state_dict(**models)
    without_clip_l = to_sd3_state_dict(**{**models, "text_encoder": None})  # a part that is absent is left out
    assert not any(k.startswith("text_encoders.clip_l.") for k in without_clip_l)
    pipe.transformer.register_buffer("mystery", torch.zeros(1))
    with pytest.raises(UserError, match="SD3 transformer has weights the SD3 single-file layout has no place"):
        mmdit_to_original(pipe.transformer)


# ---- a full fine-tune's outputs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_flux(tiny_flux_path):
    return tiny_flux_path


def _outputs_of_a_full_run(family_name, model, tmp_path, *overrides, warnings=None):
    """The family's own outputs (save_flow_outputs) on a stand-in trainer that has what they read. `ctx.unwrap`
    hands out a different, "trained" copy of the transformer, as FSDP's gathered copy on rank 0 is: the outputs
    must hold its weights."""
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    from trainer.core.config import load_config
    from trainer.families import get_family
    from trainer.families.flow.outputs import save_flow_outputs

    (tmp_path / "data").mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"model.path={model}", f"model.family={family_name}", "method=full", "name=my-run",
                             f"data.path={tmp_path / 'data'}", *overrides])  # fmt: skip
    cls = FluxPipeline if family_name == "flux" else StableDiffusion3Pipeline
    pipe, gathered = cls.from_pretrained(model), cls.from_pretrained(model).transformer
    with torch.no_grad():
        for p in gathered.parameters():
            p.add_(0.25)
    live = pipe.transformer
    warnings = [] if warnings is None else warnings  # what the run logged, for callers that look
    ctx = SimpleNamespace(unwrap=lambda m: gathered if m is live else m, device=torch.device("cpu"),
                          log_warning=warnings.append)
    model = get_family(family_name)(SimpleNamespace(config=cfg))  # the family's export hooks, on this pipeline
    model.flow.pipe, model.flow.transformer = pipe, live
    trainer = SimpleNamespace(cfg=cfg, ctx=ctx, name=family_name, pipe=pipe, transformer=live, model=model)
    outputs = save_flow_outputs(trainer, tmp_path / "output", step=3)
    assert pipe.transformer is live  # the pipeline got its own transformer back
    return pipe, gathered, outputs


def test_a_flux_full_fine_tune_writes_the_bfl_file_beside_the_diffusers_folder(tiny_flux, tmp_path,
                                                                              diffusers_reads_tiny_flux):
    from diffusers import FluxTransformer2DModel

    _, gathered, outputs = _outputs_of_a_full_run("flux", tiny_flux, tmp_path)
    output = tmp_path / "output"
    assert outputs == [str(output / "diffusers"), str(output / "my-run.safetensors")]
    folder = FluxTransformer2DModel.from_pretrained(output / "diffusers" / "transformer")
    _assert_same(folder.state_dict(), gathered.state_dict(), "diffusers folder")
    tensors = load_file(outputs[1])
    assert {v.dtype for v in tensors.values()} == {torch.bfloat16}
    assert "guidance_in.out_layer.bias" in tensors and not any(k.startswith("model.") for k in tensors)
    loaded = FluxTransformer2DModel.from_single_file(outputs[1], config=outputs[0], subfolder="transformer",
                                                     local_files_only=True)
    _assert_same(loaded.state_dict(), gathered.state_dict(), "single file", cast=torch.bfloat16)
    with safe_open(outputs[1], "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.architecture"] == "flux-1-dev" and meta["modelspec.title"] == "my-run"
    assert (meta["family"], meta["method"], meta["base_model"]) == ("flux", "full", str(tiny_flux))
    assert meta["steps"] == "3"
    assert not list(output.glob("*.partial"))

    _, _, outputs = _outputs_of_a_full_run("flux", tiny_flux, tmp_path / "off", "full.save_single_file=false")
    assert outputs == [str(tmp_path / "off" / "output" / "diffusers")]


def test_an_sd3_full_fine_tune_writes_the_single_file_beside_the_diffusers_folder(tiny_sd3, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pipe, gathered, outputs = _outputs_of_a_full_run("sd3", tiny_sd3, tmp_path)
    assert outputs == [str(tmp_path / "output" / "diffusers"), str(tmp_path / "output" / "my-run.safetensors")]
    loaded = StableDiffusion3Pipeline.from_single_file(outputs[1], config=outputs[0], local_files_only=True)
    _assert_same(loaded.transformer.state_dict(), gathered.state_dict(), "transformer", cast=torch.bfloat16)
    for name in COMPONENTS[1:]:  # frozen: the base model's, rounded to bf16
        _assert_same(getattr(loaded, name).state_dict(), getattr(pipe, name).state_dict(), name, cast=torch.bfloat16)
    with safe_open(outputs[1], "pt") as f:
        meta = f.metadata()
    assert (meta["modelspec.architecture"], meta["family"], meta["method"]) == ("stable-diffusion-3", "sd3", "full")


def test_a_model_the_single_file_layout_cannot_hold_still_gets_its_folder_and_a_warning(tiny_sd3, tmp_path):
    """A CLIP-L with a trained projection has no place in SD3's layout: at the end of a run that must not fail the
    run or lose the diffusers folder; it is a warning naming the key to set."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(tiny_sd3)
    with torch.no_grad():
        pipe.text_encoder.text_projection.weight.add_(0.1)
    pipe.save_pretrained(tmp_path / "model", safe_serialization=True)
    warnings = []
    _, _, outputs = _outputs_of_a_full_run("sd3", tmp_path / "model", tmp_path, warnings=warnings)
    assert outputs == [str(tmp_path / "output" / "diffusers")]
    assert (tmp_path / "output" / "diffusers" / "model_index.json").is_file()
    assert not (tmp_path / "output" / "my-run.safetensors").exists()
    [warning] = warnings
    assert "no single file" in warning and "full.save_single_file=false" in warning
