"""A diffusers SD 1.x pipeline as one original-layout (LDM/CompVis) ``.safetensors`` for A1111, ComfyUI, Forge.

The key mapping is that of diffusers' ``scripts/convert_diffusers_to_original_stable_diffusion.py``
(Apache-2.0, https://github.com/huggingface/diffusers), reworked as a module: the script hard-codes SD's
4 blocks x 2 layers, here the block indices come from the model configs, so any SD-1-shaped UNet/VAE (including
the tiny test model) converts; keys the mapping does not know raise instead of being written under a wrong name.

Layout written: ``model.diffusion_model.*`` (UNet), ``first_stage_model.*`` (VAE, attention projections as
1x1 convs), ``cond_stage_model.transformer.text_model.*`` (CLIP ViT-L text encoder, SD 1.x).

SD 2.x is not supported: its text encoder must go back to OpenCLIP's layout (``cond_stage_model.model.*``,
fused ``in_proj`` q/k/v, and a 24th transformer layer diffusers does not keep), which nothing here verifies yet.
SDXL (which reuses the UNet, VAE and CLIP mappings below) is written by ``trainer.families.sdxl.checkpoint``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer.errors import UserError

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}  # fmt: skip
_UNET_FIXED = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
               "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}  # fmt: skip
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def _resnet(rest: str) -> str:
    layer, _, param = rest.partition(".")
    if layer not in _RESNET:
        raise KeyError(rest)
    return f"{_RESNET[layer]}.{param}"


def unet_to_ldm(
    state: Mapping[str, torch.Tensor], config: Mapping, *, fixed: Mapping[str, str] | None = None,
    layout: str = "SD 1.x",
) -> dict[str, torch.Tensor]:
    """Diffusers ``UNet2DConditionModel`` weights -> LDM ``openaimodel.UNetModel`` names (no prefix).

    ``fixed`` adds module renames (diffusers module path -> LDM one) to the shared ones, e.g. SDXL's
    ``add_embedding``; ``layout`` names the file layout in the error about weights that have no place in it.
    """
    fixed = {**_UNET_FIXED, **(fixed or {})}
    per = config["layers_per_block"]
    if not isinstance(per, int):
        raise UserError("only UNets with the same number of layers in every block can be saved as a single file")
    step = per + 1  # LDM numbers resnets and the down/upsampler of a level consecutively
    up_has_attention = ["CrossAttn" in t for t in config["up_block_types"]]
    out, unknown = {}, []
    for key, tensor in state.items():
        try:
            out[_unet_key(key, per, step, up_has_attention, fixed)] = tensor
        except (KeyError, ValueError):
            unknown.append(key)
    _raise_unknown("UNet", unknown, layout)
    return out


def _unet_key(key: str, per: int, step: int, up_has_attention: list[bool], fixed: Mapping[str, str]) -> str:
    module, _, param = key.rpartition(".")
    if module in fixed:
        return f"{fixed[module]}.{param}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
        block, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        index = 1 + block * step + layer
        return f"input_blocks.{index}.0.{_resnet(rest)}" if kind == "resnets" else f"input_blocks.{index}.1.{rest}"
    if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(\w+)", key):
        return f"input_blocks.{(int(m[1]) + 1) * step}.0.op.{m[2]}"
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key):
        kind, layer, rest = m[1], int(m[2]), m[3]
        return f"middle_block.{2 * layer}.{_resnet(rest)}" if kind == "resnets" else f"middle_block.1.{rest}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)", key):
        block, kind, layer, rest = int(m[1]), m[2], int(m[3]), m[4]
        index = block * step + layer
        return f"output_blocks.{index}.0.{_resnet(rest)}" if kind == "resnets" else f"output_blocks.{index}.1.{rest}"
    if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(\w+)", key):
        block = int(m[1])
        # The upsampler follows the last resnet of the level, after its attention when the level has one.
        return f"output_blocks.{block * step + per}.{2 if up_has_attention[block] else 1}.conv.{m[2]}"
    raise KeyError(key)


def vae_to_ldm(
    state: Mapping[str, torch.Tensor], config: Mapping, *, layout: str = "SD 1.x"
) -> dict[str, torch.Tensor]:
    """Diffusers ``AutoencoderKL`` weights -> LDM ``AutoencoderKL`` names (no prefix)."""
    levels = len(config["block_out_channels"])
    out, unknown = {}, []
    for key, tensor in state.items():
        try:
            new_key, reshape = _vae_key(key, levels)
        except (KeyError, ValueError):
            unknown.append(key)
            continue
        # LDM's mid-block attention uses 1x1 convolutions where diffusers uses linear layers.
        out[new_key] = tensor.reshape(*tensor.shape, 1, 1) if reshape and tensor.ndim == 2 else tensor
    _raise_unknown("VAE", unknown, layout)
    return out


def _vae_key(key: str, levels: int) -> tuple[str, bool]:
    key = key.replace(".conv_norm_out.", ".norm_out.").replace(".conv_shortcut.", ".nin_shortcut.")
    if re.fullmatch(r"(encoder|decoder)\.(conv_in|conv_out|norm_out)\.\w+|(post_)?quant_conv\.\w+", key):
        return key, False
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"encoder.down.{m[1]}.block.{m[2]}.{m[3]}", False
    if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.(\w+)", key):
        return f"encoder.down.{m[1]}.downsample.conv.{m[2]}", False
    # LDM numbers decoder levels from the lowest resolution up, diffusers in the order they run.
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
        return f"decoder.up.{levels - 1 - int(m[1])}.block.{m[2]}.{m[3]}", False
    if m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.conv\.(\w+)", key):
        return f"decoder.up.{levels - 1 - int(m[1])}.upsample.conv.{m[2]}", False
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.+)", key):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}", False
    if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", key):
        return f"{m[1]}.mid.attn_1.{_VAE_ATTENTION[m[2]]}.{m[3]}", m[2] != "group_norm"
    raise KeyError(key)


def text_encoder_to_ldm(state: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """CLIP ViT-L text encoder (SD 1.x) weights -> names under ``cond_stage_model.transformer`` (no prefix).

    The layout is the transformers one, with ``text_model.`` put back where transformers 5 flattened it away.
    """
    if _is_open_clip(config):
        raise UserError(
            "saving an SD 2.x model as one file is not supported yet: its OpenCLIP text encoder needs the original "
            "OpenCLIP layout (cond_stage_model.model.*, fused q/k/v), which this exporter does not write. Use the "
            "diffusers folder (output/), which A1111 and ComfyUI can also load"
        )
    return clip_to_ldm(state, config)


def clip_to_ldm(state: Mapping[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A transformers ``CLIPTextModel``'s weights in the layout LDM/SGM checkpoints keep them (no prefix): the
    transformers names, with ``text_model.`` put back where transformers 5 flattened it away, and the
    ``position_ids`` buffer. Shared by SD 1.x (``cond_stage_model.transformer.``) and SDXL's first text encoder
    (``conditioner.embedders.0.transformer.``)."""
    out = {}
    for key, tensor in state.items():
        out[key if key.startswith("text_model.") else f"text_model.{key}"] = tensor
    positions = "text_model.embeddings.position_ids"
    if positions not in out:
        # SD 1.x / SDXL checkpoints carry this buffer; transformers 5 no longer saves it. Strict loaders want it.
        out[positions] = torch.arange(config.max_position_embeddings, dtype=torch.int64)[None]
    return out


def _is_open_clip(config) -> bool:
    # SD 2.x's OpenCLIP ViT-H uses plain GELU (CLIP ViT-L quick_gelu) and is 1024 wide (23 layers kept).
    return getattr(config, "hidden_act", "quick_gelu") == "gelu" or getattr(config, "hidden_size", 0) == 1024


def _raise_unknown(what: str, keys: list[str], layout: str = "SD 1.x") -> None:
    if keys:
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        raise UserError(f"the {what} has weights the {layout} single-file layout has no place for: {shown}")


def _components(source) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """(unet, vae, text_encoder) from a diffusers folder, a pipeline, or a mapping with those three keys."""
    from trainer.families.components.lora_files import unwrap

    if isinstance(source, (str, os.PathLike)):
        from diffusers import AutoencoderKL, UNet2DConditionModel
        from transformers import CLIPTextModel

        folder = Path(source)
        if not (folder / "model_index.json").is_file():
            raise UserError(f"{folder} is not a diffusers pipeline folder (no model_index.json)")
        return (
            UNet2DConditionModel.from_pretrained(folder, subfolder="unet", local_files_only=True),
            AutoencoderKL.from_pretrained(folder, subfolder="vae", local_files_only=True),
            CLIPTextModel.from_pretrained(folder, subfolder="text_encoder", local_files_only=True),
        )
    get = source.__getitem__ if isinstance(source, Mapping) else lambda name: getattr(source, name)
    return unwrap(get("unet")), unwrap(get("vae")), unwrap(get("text_encoder"))


def to_ldm_state_dict(unet, vae, text_encoder) -> dict[str, torch.Tensor]:
    """The whole single-file state dict, prefixes included, tensors as the models hold them."""
    states = {"UNet": unet.state_dict(), "VAE": vae.state_dict(), "text encoder": text_encoder.state_dict()}
    for what, state in states.items():
        if any("lora_" in k or ".base_layer." in k for k in state):
            raise ValueError(f"the {what} still has LoRA layers: fuse and unload them before saving a single file")
    out = {f"model.diffusion_model.{k}": v for k, v in unet_to_ldm(states["UNet"], unet.config).items()}
    out.update({f"first_stage_model.{k}": v for k, v in vae_to_ldm(states["VAE"], vae.config).items()})
    te = text_encoder_to_ldm(states["text encoder"], text_encoder.config)
    out.update({f"cond_stage_model.transformer.{k}": v for k, v in te.items()})
    return out


def save_single_file(
    pipeline_dir_or_components,
    out_file: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float16,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write an SD 1.x pipeline (folder, pipeline object, or {"unet", "vae", "text_encoder"}) as one LDM file.

    Floating-point weights are cast to ``dtype`` (fp16 is what A1111/ComfyUI users expect: half the size, and
    they run in fp16 anyway); integer buffers are kept. Returns the path written.
    """
    unet, vae, text_encoder = _components(pipeline_dir_or_components)
    return write_checkpoint(to_ldm_state_dict(unet, vae, text_encoder), out_file, dtype=dtype,
                            architecture="stable-diffusion-v1", metadata=metadata)


def write_checkpoint(state: Mapping[str, torch.Tensor], out_file: str | os.PathLike, *, dtype: torch.dtype,
                     architecture: str, metadata: Mapping[str, str] | None = None) -> Path:
    """One original-layout `.safetensors` with modelspec metadata: floating-point tensors cast to `dtype`,
    integer buffers kept; written to a `.partial` file and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    state = {
        k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().to("cpu")).contiguous()
        for k, v in state.items()
    }
    header = {
        "format": "pt",
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": architecture,
        "modelspec.implementation": "https://github.com/Stability-AI/generative-models",
        "modelspec.title": Path(out_file).stem,
        **{k: str(v) for k, v in (metadata or {}).items()},
    }
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    partial = out_file.with_name(out_file.name + ".partial")
    save_file(state, str(partial), metadata=header)
    os.replace(partial, out_file)
    return out_file
