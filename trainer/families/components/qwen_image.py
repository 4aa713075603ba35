"""What the Qwen-Image families (Qwen-Image, Qwen-Image-Edit) share: one QwenImageTransformer2DModel, one video
VAE, one ComfyUI layout. Each family's module cites the pipeline lines; this holds the parts, written once.

- `ImageVAE`: the 3D VAE as the latent cache calls an image VAE (one frame);
- `normalize_latents`: its per-channel (z - latents_mean) / latents_std;
- `BLOCK_TARGETS` / `reaching_prediction`: the LoRA layers, without the last block's text stream (never read);
- `kohya_lora` / `comfy_name` / `KOHYA_METADATA`: ComfyUI's file, `lora_unet_<diffusers path>` with alphas.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from trainer.families.components.kohya import convert_lora_state, kohya_module_name

BLOCK_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                 "txt_mlp.net.2")

# The text stream's own outputs: read by the next block only (its key/value projections feed the image tokens).
TEXT_ONLY = ("attn.add_q_proj", "attn.to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")


class _Frame:
    """A latent distribution without its frame dimension (one frame: an image)."""

    def __init__(self, dist: Any):
        self.mean, self.std = dist.mean[:, :, 0], dist.std[:, :, 0]


class ImageVAE(torch.nn.Module):
    """Qwen-Image's 3D VAE as the latent cache calls an image VAE: (B, C, H, W) pixels in, (B, C, h, w) mean and
    std out. A Module holding the VAE, so that the cache key's weight fingerprint reads the same weights."""

    vae: Any  # AutoencoderKLQwenImage (Module.__getattr__ would type it as Tensor | Module)

    def __init__(self, vae: torch.nn.Module):
        super().__init__()
        self.vae = vae

    @property
    def dtype(self) -> torch.dtype:
        return self.vae.dtype

    @property
    def config(self) -> Any:
        return self.vae.config

    def encode(self, pixels: torch.Tensor) -> Any:
        return SimpleNamespace(latent_dist=_Frame(self.vae.encode(pixels.unsqueeze(2)).latent_dist))  # one frame


def normalize_latents(vae_config: Any, latents: torch.Tensor) -> torch.Tensor:
    """(z - latents_mean) * (1 / latents_std) per channel: the DreamBooth script's exact operations (lines
    1221-1222, 1737), the inverse of what the pipelines decode."""
    mean = torch.tensor(vae_config.latents_mean).view(1, vae_config.z_dim, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae_config.latents_std).view(1, vae_config.z_dim, 1, 1).to(latents.device,
                                                                                          latents.dtype)
    return (latents - mean) * inv_std


def reaching_prediction(paths: list[str], num_layers: int) -> list[str]:
    """`paths` without the last block's text-query projection, text output projection and text MLP: the
    transformer reads only the image stream after its last block (transformer_qwenimage.py lines 981-983), so
    they train nothing (no gradient at all for the output projection and MLP, which DDP refuses)."""
    last = f"transformer_blocks.{num_layers - 1}."
    return [p for p in paths if not (p.startswith(last) and p[len(last):] in TEXT_ONLY)]


def kohya_lora(state: dict[str, torch.Tensor], alphas: dict[str, float]) -> dict[str, torch.Tensor]:
    """`lora_unet_<diffusers path>` with lora_down/lora_up/alpha: ComfyUI's QwenImage model has diffusers' module
    names (comfy/ldm/qwen_image/model.py) and maps `lora_unet_<path with _>` onto every
    `diffusion_model.<path>.weight` (comfy/lora.py model_lora_keys_unet, lines 179-183). It also reads the diffusers
    file's `transformer.<path>` keys (lines 306-313), but that file has no alphas and ComfyUI then scales by 1, not
    alpha/rank: this file carries them. ComfyUI runs Qwen-Image-Edit on the same QwenImage model (comfy/
    supported_models.py QwenImage; its edit conditioning is `reference_latents`), so the layout is one."""
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    return convert_lora_state(state, prefix="lora_unet",
                              alpha={kohya_module_name(p, "lora_unet"): a for p, a in alphas.items()})


def comfy_name(path: str) -> str:
    """LoKr/LoHa/DoRA under the same `lora_unet_<path>` names: ComfyUI maps OneTrainer's `lora_transformer_` names
    only for SD3, AuraFlow and Flux (comfy/lora.py lines 221, 262), not for QwenImage (lines 306-313)."""
    return kohya_module_name(path, "lora_unet")


def kohya_metadata(architecture: str, implementation: str) -> dict[str, str]:
    return {"ss_base_model_version": "qwen_image", "ss_v2": "False", "modelspec.architecture": architecture,
            "modelspec.implementation": implementation, "modelspec.prediction_type": "flow"}
