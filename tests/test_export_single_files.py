"""The original-release single files of the newer flow families, checked through diffusers' own readers.

- Chroma (lodestones' Chroma1-HD.safetensors layout): a tiny transformer loads back through
  `ChromaTransformer2DModel.from_single_file` tensor for tensor (its converter's one hard-coded width generalised,
  as FLUX.1's in test_export_flow); the full-size key set on the meta device through the unmodified converter.
- FLUX.2 [dev] and [klein] (BFL's flux2-dev.safetensors layout): tiny transformers with and without the guidance
  embedding load back through the unmodified `Flux2Transformer2DModel.from_single_file`; full-size key sets on
  the meta device.
- A full fine-tune's outputs (`save_flow_full` on a stand-in pipeline) hold `<name>.safetensors` beside
  `diffusers/` for Chroma and FLUX.2; Z-Image and Qwen-Image, whose releases are diffusers folders only, keep the
  folder with a warning that says so.
FLUX.1 Kontext writes FLUX.1's own file (BFL's flux1-kontext-dev.safetensors has FLUX.1 [dev]'s layout), which
test_export_flow checks; here only that its family's hook writes it.
"""

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.test_export_flow import _assert_converter_reads_exactly, _assert_same, _tiny_flux, flux_converter
from trainer.families.chroma.checkpoint import save_chroma_single_file, to_chroma_state_dict
from trainer.families.flux2.checkpoint import save_flux2_single_file, to_flux2_state_dict

# as the demo's tiny Chroma (chroma/demo.py), with two guidance-layer MLPs so that their numbering is checked
CHROMA_TINY = {"patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16,
               "num_attention_heads": 2, "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6),
               "approximator_num_channels": 16, "approximator_hidden_dim": 32, "approximator_layers": 2}


def _tiny_chroma(seed: int = 0):
    from diffusers import ChromaTransformer2DModel

    torch.manual_seed(seed)
    return ChromaTransformer2DModel(**CHROMA_TINY)


def _tiny_flux2(guidance: bool, seed: int = 0):
    from trainer.families.flux2.demo import tiny_transformer

    torch.manual_seed(seed)
    return tiny_transformer(text_width=8, guidance_embeds=guidance)


@pytest.fixture
def diffusers_reads_tiny_chroma(monkeypatch):
    """`ChromaTransformer2DModel.from_single_file` with the converter's width generalised to the tiny one (32)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES["ChromaTransformer2DModel"], "checkpoint_mapping_fn",
                        flux_converter(32, convert_chroma_transformer_checkpoint_to_diffusers))


def test_chroma_round_trips_through_diffusers_from_single_file(diffusers_reads_tiny_chroma, tmp_path):
    from diffusers import ChromaTransformer2DModel

    transformer = _tiny_chroma()
    transformer.save_pretrained(tmp_path / "model" / "transformer")  # the config diffusers reads
    path = save_chroma_single_file(transformer, tmp_path / "chroma.safetensors", dtype=torch.float32)
    loaded = ChromaTransformer2DModel.from_single_file(str(path), config=str(tmp_path / "model"),
                                                       subfolder="transformer", local_files_only=True)
    _assert_same(loaded.state_dict(), transformer.state_dict(), "transformer")

    tensors = load_file(path)
    guidance = transformer.distilled_guidance_layer
    assert torch.equal(tensors["distilled_guidance_layer.layers.1.out_layer.weight"],
                       guidance.layers[1].linear_2.weight)
    assert torch.equal(tensors["distilled_guidance_layer.norms.1.scale"], guidance.norms[1].weight)
    block = transformer.single_transformer_blocks[1]
    parts = (block.attn.to_q, block.attn.to_k, block.attn.to_v, block.proj_mlp)
    assert torch.equal(tensors["single_blocks.1.linear1.weight"], torch.cat([m.weight for m in parts]))
    # the keys ComfyUI detects Chroma by (comfy/model_detection.py); what Chroma pruned from FLUX.1 is not in the
    # file (diffusers' converter would not read it)
    assert {"distilled_guidance_layer.norms.0.scale", "double_blocks.0.img_attn.norm.key_norm.scale"} <= set(tensors)
    assert not [k for k in tensors if "_mod." in k or "modulation" in k or k.startswith(("time_in", "vector_in"))]
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["modelspec.architecture"] == "chroma"
    assert meta["modelspec.implementation"] == "https://huggingface.co/lodestones/Chroma1-HD"


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "klein"])
def test_flux2_round_trips_through_diffusers_from_single_file(guidance, tmp_path):
    from diffusers import Flux2Transformer2DModel

    transformer = _tiny_flux2(guidance)
    transformer.save_pretrained(tmp_path / "model" / "transformer")
    path = save_flux2_single_file(transformer, tmp_path / "flux2.safetensors", architecture="flux2",
                                  dtype=torch.float32)
    loaded = Flux2Transformer2DModel.from_single_file(str(path), config=str(tmp_path / "model"),
                                                      subfolder="transformer", local_files_only=True)
    _assert_same(loaded.state_dict(), transformer.state_dict(), "transformer")

    tensors = load_file(path)
    assert ("guidance_in.in_layer.weight" in tensors) is guidance
    assert {"double_stream_modulation_img.lin.weight", "img_in.weight"} <= set(tensors)  # ComfyUI's FLUX.2 keys
    attn = transformer.transformer_blocks[1].attn
    assert torch.equal(tensors["double_blocks.1.img_attn.qkv.weight"],
                       torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
    assert torch.equal(tensors["single_blocks.1.linear1.weight"],
                       transformer.single_transformer_blocks[1].attn.to_qkv_mlp_proj.weight)
    scale, shift = transformer.norm_out.linear.weight.chunk(2)
    assert torch.equal(tensors["final_layer.adaLN_modulation.1.weight"], torch.cat([shift, scale]))


def test_full_size_layouts_are_what_diffusers_converters_consume():
    """The published models' key sets (on the meta device: no memory) through the unmodified converters, which pop
    every key they read: nothing left over, nothing missing, and diffusers recognises each file's model type."""
    from diffusers import ChromaTransformer2DModel, Flux2Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers,
        convert_flux2_transformer_checkpoint_to_diffusers,
        infer_diffusers_model_type,
    )

    with torch.device("meta"):
        chroma = ChromaTransformer2DModel()  # Chroma1-HD's defaults: 19 double, 38 single blocks
        flux2 = Flux2Transformer2DModel()  # FLUX.2 [dev]'s: 8 double, 48 single blocks, guidance embedding
    state = to_chroma_state_dict(chroma)
    assert infer_diffusers_model_type(state) == "chroma"
    assert state["single_blocks.37.linear1.weight"].shape == (3 * 3072 + 12288, 3072)
    _assert_converter_reads_exactly(convert_chroma_transformer_checkpoint_to_diffusers, state, chroma)
    state = to_flux2_state_dict(flux2)
    assert infer_diffusers_model_type(state) == "flux-2-dev"
    assert "guidance_in.out_layer.weight" in state and "single_blocks.47.linear2.weight" in state
    _assert_converter_reads_exactly(convert_flux2_transformer_checkpoint_to_diffusers, state, flux2)


def _full_outputs(family_name: str, transformer, tmp_path, warnings: list, *overrides: str):
    """`save_flow_full` of the family on a stand-in pipeline whose folder is the transformer's alone."""
    from trainer.core.config import load_config
    from trainer.families import get_family
    from trainer.families.flow.outputs import save_flow_full

    for folder in ("data", "base", "control"):  # the config checks that they exist; none is read
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, [f"model.path={tmp_path / 'base'}", f"model.family={family_name}", "method=full",
                             "name=my-run", f"data.path={tmp_path / 'data'}", *overrides])
    pipe = SimpleNamespace(transformer=transformer)
    pipe.save_pretrained = lambda folder, **_: pipe.transformer.save_pretrained(folder / "transformer")
    ctx = SimpleNamespace(unwrap=lambda m: m, log_warning=warnings.append)
    model = get_family(family_name)(SimpleNamespace(config=cfg))
    trainer = SimpleNamespace(cfg=cfg, ctx=ctx, name=family_name, pipe=pipe, transformer=transformer, model=model)
    return save_flow_full(trainer, tmp_path / "output", step=3)


@pytest.mark.parametrize("family_name", ["chroma", "flux2", "flux2_klein", "flux_kontext"])
def test_a_full_fine_tune_writes_the_release_file_beside_the_diffusers_folder(family_name, tmp_path, monkeypatch):
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES["ChromaTransformer2DModel"], "checkpoint_mapping_fn",
                        flux_converter(32, convert_chroma_transformer_checkpoint_to_diffusers))
    monkeypatch.setitem(SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"], "checkpoint_mapping_fn",
                        flux_converter(32))
    transformers = {"chroma": _tiny_chroma, "flux2": lambda: _tiny_flux2(True),
                    "flux2_klein": lambda: _tiny_flux2(False),
                    "flux_kontext": lambda: _tiny_flux(True)}  # Kontext: FLUX.1 [dev]'s transformer
    transformer = transformers[family_name]()
    paired = [f"data.control_path={tmp_path / 'control'}"] if family_name == "flux_kontext" else []  # its checks
    warnings: list[str] = []
    outputs = _full_outputs(family_name, transformer, tmp_path, warnings, *paired)
    output = tmp_path / "output"
    assert outputs == [str(output / "diffusers"), str(output / "my-run.safetensors")] and warnings == []
    assert {v.dtype for v in load_file(outputs[1]).values()} == {torch.bfloat16}
    loaded = type(transformer).from_single_file(outputs[1], config=outputs[0], subfolder="transformer",
                                                local_files_only=True)
    _assert_same(loaded.state_dict(), transformer.state_dict(), "single file", cast=torch.bfloat16)
    with safe_open(outputs[1], "pt") as f:
        meta = f.metadata()
    assert (meta["family"], meta["method"], meta["steps"]) == (family_name, "full", "3")
    assert meta["modelspec.architecture"] == {"flux_kontext": "flux-1-dev"}.get(family_name, family_name)


@pytest.mark.parametrize(("family_name", "release"), [("zimage", "Tongyi-MAI/Z-Image-Turbo"),
                                                      ("qwenimage", "Qwen/Qwen-Image")])
def test_a_family_released_as_a_diffusers_folder_keeps_the_folder_and_says_why(family_name, release, tmp_path):
    warnings: list[str] = []
    outputs = _full_outputs(family_name, _tiny_chroma(), tmp_path, warnings)  # any transformer: none is written
    assert outputs == [str(tmp_path / "output" / "diffusers")]
    [warning] = warnings
    assert release in warning and "from_pretrained" in warning and "full.save_single_file=false" in warning
