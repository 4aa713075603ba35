#!/usr/bin/env python
"""SDXL and FLUX.1-dev LoRA training at 1024 px on one CUDA GPU: samples/s, peak memory and MFU.

    python bench/gpu_large.py [--out bench/gpu_large.json] [--models sdxl,flux] [--time-budget 330]
    python bench/gpu_large.py --dry-run-cpu      # the same code path, tiny models, 2 steps each, on the CPU

Nothing is downloaded: every model is built from its published config (written out below) with random weights,
directly on the GPU, the frozen parts in bf16:

- SDXL base 1.0: the UNet (UNet2DConditionModel, 2.6 B parameters); for the uncached configurations also the VAE
  (AutoencoderKL, 4 latent channels) and both text encoders (CLIP ViT-L text, OpenCLIP bigG text with projection);
- FLUX.1-dev: the transformer (FluxTransformer2DModel, 11.9 B); uncached also the VAE (16 latent channels) and the
  text encoders (CLIP ViT-L text for the pooled embedding, T5 v1.1 XXL encoder for 512 tokens).

Each model is trained as the engine trains it with LoRA: rank 16 (alpha 16, gaussian init, weights in fp32 while the
base stays bf16; SDXL on to_q/to_k/to_v/to_out.0, FLUX on those plus add_q/k/v_proj and to_add_out), bf16 autocast,
SDPA attention, AdamW (torch's default implementation) on the LoRA weights, gradient clipping at 1.0. SDXL: noise
prediction (MSE against the noise) with the `text_time` conditioning (pooled text_embeds (B, 1280), time_ids
(B, 6)). FLUX: flow matching (logit-normal sigmas, target noise - latents) on 2x2-packed latents (4096 tokens of
64 channels at 1024 px) with 512 T5 tokens, img_ids/txt_ids as FluxPipeline builds them, guidance 3.5.

Configurations, per model: gradient checkpointing off/on x inputs cached/uncached x batch sizes (SDXL 1, 2, 4;
FLUX 1, 2). Cached: random latents and random text-encoder states are the inputs (the encoders are not on the
GPU). Uncached: every step first runs the VAE encoder on a batch of random 1024x1024 images and the text encoders
on random token ids, under no_grad, as a trainer without caches does. A configuration that runs out of memory is
reported as OOM (the larger batches of that row are skipped); `--time-budget` seconds after the start whatever has
not started is listed as skipped (each model gets an equal share of the time left when it starts, so a slow first
model cannot starve the second; time it leaves unused passes on). A model that fails is reported and the other
still runs.

MFU = useful training FLOPs per second / the GPU's peak dense bf16 FLOP/s (the table in gpu_sd15.py). FLOPs are
counted with torch.utils.flop_counter.FlopCounterMode at batch 1 (matmuls, convolutions, attention; not
elementwise ops), once per model: `MFU 3x` uses 3 x the trained network's forward FLOPs, `MFU counted` the FLOPs
of one real forward + backward with LoRA. The frozen encoders' FLOPs (uncached configurations) are counted and
reported separately, and are not counted as useful in either column. Exit status: 0, or 2 without CUDA (unless
--dry-run-cpu).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._common import compile_repeated_blocks, fmt, markdown_table, max_rss_mb  # noqa: E402
from bench.gpu_sd15 import peak_tflops_for  # noqa: E402

# ---- published configs, written out -----------------------------------------------------------------------------
# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json (keys not listed take diffusers' defaults, which are
# the file's values).
SDXL_UNET = {
    "sample_size": 128,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "only_cross_attention": False,
    "block_out_channels": [320, 640, 1280],
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "cross_attention_dim": 2048,
    "transformer_layers_per_block": [1, 2, 10],
    "attention_head_dim": [5, 10, 20],  # diffusers' naming: these are the head counts (64 channels per head)
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,  # 1280 (pooled text) + 6 x 256 (time ids)
    "upcast_attention": False,
    "resnet_time_scale_shift": "default",
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
}
# stabilityai/stable-diffusion-xl-base-1.0, vae/config.json.
SDXL_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.13025,
    "force_upcast": True,
}
# text_encoder/config.json of SDXL base and of FLUX.1-dev: the text tower of OpenAI CLIP ViT-L/14.
CLIP_L_TEXT = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
# SDXL text_encoder_2/config.json: OpenCLIP ViT-bigG/14 text tower (CLIPTextModelWithProjection).
OPENCLIP_BIGG_TEXT = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "projection_dim": 1280,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
# black-forest-labs/FLUX.1-dev, transformer/config.json.
FLUX_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
# FLUX.1-dev vae/config.json.
FLUX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}
# FLUX.1-dev text_encoder_2/config.json: the encoder of Google's T5 v1.1 XXL (T5EncoderModel).
T5_XXL_ENCODER = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "layer_norm_epsilon": 1e-6,
    "feed_forward_proj": "gated-gelu",
}

# The same architectures shrunk for --dry-run-cpu (same classes, same code path).
TINY_VAE = {"block_out_channels": [8, 16], "down_block_types": ["DownEncoderBlock2D"] * 2,
            "up_block_types": ["UpDecoderBlock2D"] * 2, "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 32}
TINY_CLIP = {"hidden_size": 16, "intermediate_size": 32, "projection_dim": 16, "num_hidden_layers": 2,
             "num_attention_heads": 2}
TINY_T5 = {"d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_heads": 2, "vocab_size": 128}
SDXL_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# The engine's default FLUX LoRA layers (trainer/families/flow/flux_layout.py DOUBLE_TARGETS / SINGLE_TARGETS, written out
# here so this script needs no trainer imports): attention of both streams and both MLPs in the double blocks;
# q/k/v, proj_mlp and proj_out in the single blocks. A regex: peft matches it against the full module path.
FLUX_LORA_TARGETS = (r"(transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj"
                     r"|to_add_out)|ff\.net\.0\.proj|ff\.net\.2|ff_context\.net\.0\.proj|ff_context\.net\.2))"
                     r"|(single_transformer_blocks\.\d+\.(attn\.to_q|attn\.to_k|attn\.to_v|proj_mlp|proj_out))")

MODELS = {
    "sdxl": {
        "label": "SDXL base 1.0 UNet",
        "net": SDXL_UNET, "vae": SDXL_VAE, "text": [CLIP_L_TEXT, OPENCLIP_BIGG_TEXT], "tokens": [77, 77],
        "targets": SDXL_LORA_TARGETS, "batches": [1, 2, 4], "steps": 10, "warmup": 2,
        "tiny": {"net": {"sample_size": 16, "block_out_channels": [32, 64, 64], "transformer_layers_per_block": [1, 1, 2],
                         "attention_head_dim": [2, 4, 4], "layers_per_block": 1, "norm_num_groups": 8,
                         "cross_attention_dim": 48, "addition_time_embed_dim": 8,
                         "projection_class_embeddings_input_dim": 32 + 6 * 8},
                 "text": [TINY_CLIP, {**TINY_CLIP, "hidden_size": 32, "projection_dim": 32, "intermediate_size": 64}],
                 "tokens": [77, 77]},
    },
    "flux": {
        "label": "FLUX.1-dev transformer",
        "net": FLUX_TRANSFORMER, "vae": FLUX_VAE, "text": [CLIP_L_TEXT, T5_XXL_ENCODER], "tokens": [77, 512],
        "targets": FLUX_LORA_TARGETS, "batches": [1, 2], "steps": 8, "warmup": 2, "guidance": 3.5,
        "tiny": {"net": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                         "joint_attention_dim": 32, "pooled_projection_dim": 16, "axes_dims_rope": [4, 6, 6]},
                 "text": [TINY_CLIP, TINY_T5], "tokens": [77, 32]},
    },
}
IMAGE_PX = 1024


def model_spec(name: str, dry: bool) -> dict:
    """The spec of one model; for the dry run its tiny version (every config shrunk, the rest unchanged)."""
    spec = {k: v for k, v in MODELS[name].items() if k != "tiny"}
    spec["image_px"] = IMAGE_PX
    if dry:
        tiny = MODELS[name]["tiny"]
        spec["net"] = {**spec["net"], **tiny["net"]}
        spec["vae"] = {**spec["vae"], **TINY_VAE}
        spec["text"] = [{**full, **small} for full, small in zip(spec["text"], tiny["text"])]
        spec["tokens"] = tiny["tokens"]
        spec["image_px"] = 32
    factor = 2 ** (len(spec["vae"]["block_out_channels"]) - 1)
    spec["latent_px"] = spec["image_px"] // factor  # 128 at 1024 px
    return spec


# ---- models -----------------------------------------------------------------------------------------------------


def frozen_bf16(module):
    import torch
    from diffusers.utils import logging as diffusers_logging

    module.requires_grad_(False)
    module.eval()
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # silences "modules that should be kept in float32: []" (there are none)
    try:
        return module.to(torch.bfloat16)
    finally:
        diffusers_logging.set_verbosity(level)


def store_base_weights(net, spec: dict, device) -> None:
    """`--base-weights fp8 | fp8-compute | nf4`: the frozen network stored as the engine stores it for
    `model.base_weights` (trainer.families.components.base_weights.place_frozen_network; fp8-compute is fp8 with
    `model.fp8_compute` on), before LoRA is added."""
    import torch

    from trainer.families.components.base_weights import place_frozen_network

    storage = spec.get("base_weights", "bf16")
    if storage != "bf16":
        place_frozen_network(net, "fp8" if storage == "fp8-compute" else storage, device, torch.bfloat16,
                             fp8_compute=storage == "fp8-compute")


def n_params(module) -> int:
    return sum(p.numel() for p in module.parameters())


class Workload:
    """One model: the trained network with LoRA, on demand its frozen encoders, inputs, and the loss."""

    name = ""

    def __init__(self, spec: dict, device, lora_rank: int):
        self.spec, self.device, self.lora_rank = spec, device, lora_rank
        self.encoders: dict = {}
        self.net = self.build_net()
        self.net_params = n_params(self.net)
        self.params = self.add_lora()

    # -- building
    def build_net(self):
        raise NotImplementedError

    def add_lora(self):
        import torch
        from peft import LoraConfig

        torch.manual_seed(0)
        self.net.add_adapter(LoraConfig(r=self.lora_rank, lora_alpha=self.lora_rank, init_lora_weights="gaussian",
                                        target_modules=self.spec["targets"]))
        for p in self.net.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # trained weights stay fp32, as in the engine
        self.lora_layers = sum(1 for name, _ in self.net.named_modules() if name.endswith(".lora_A"))
        if self.spec.get("block_swap"):  # --block-swap N: the engine's model.block_swap, after LoRA as there
            from trainer.families import spec_of
            from trainer.families.components.block_swap import BlockSwap, last_blocks

            blocks = last_blocks(self.net, spec_of(self.name).block_lists, self.spec["block_swap"])
            self.block_swap = BlockSwap(blocks, torch.device(self.device))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.net.train()
        return [p for p in self.net.parameters() if p.requires_grad]

    def build_encoders(self) -> None:
        import torch
        from diffusers import AutoencoderKL

        torch.manual_seed(1)
        with torch.device(self.device):
            self.encoders["vae"] = frozen_bf16(AutoencoderKL(**self.spec["vae"]))
            self.build_text_encoders()

    def build_text_encoders(self) -> None:
        raise NotImplementedError

    def encoder_params(self) -> dict:
        return {name: n_params(m) for name, m in self.encoders.items()}

    def drop_encoders(self) -> None:
        self.encoders.clear()

    def set_checkpointing(self, on: bool) -> None:
        if on:
            self.net.enable_gradient_checkpointing()
        else:
            self.net.disable_gradient_checkpointing()

    # -- inputs
    def raw_inputs(self, batch: int) -> dict:
        """What a trainer without caches starts from: images in [-1, 1] and token ids, one per text encoder."""
        import torch

        g = torch.Generator(self.device).manual_seed(1000 + batch)
        px = self.spec["image_px"]
        out = {"images": (torch.rand(batch, 3, px, px, device=self.device, generator=g) * 2 - 1).to(torch.bfloat16)}
        for i, (cfg, tokens) in enumerate(zip(self.spec["text"], self.spec["tokens"])):
            out[f"ids{i}"] = torch.randint(0, cfg["vocab_size"], (batch, tokens), device=self.device, generator=g)
        return out

    def cached_inputs(self, batch: int) -> dict:
        raise NotImplementedError

    def encode_images(self, raw: dict):
        raise NotImplementedError

    def encode_text(self, raw: dict) -> dict:
        raise NotImplementedError

    def encode(self, raw: dict) -> dict:
        return {"latents": self.encode_images(raw), **self.encode_text(raw)}

    def loss(self, x: dict):
        raise NotImplementedError


class SDXLWorkload(Workload):
    name = "sdxl"

    def build_net(self):
        import torch
        from diffusers import UNet2DConditionModel
        from diffusers.models.attention_processor import AttnProcessor2_0

        torch.manual_seed(0)
        with torch.device(self.device):
            unet = frozen_bf16(UNet2DConditionModel(**self.spec["net"]))
        store_base_weights(unet, self.spec, self.device)
        unet.set_attn_processor(AttnProcessor2_0())  # SDPA
        # SD's scaled-linear schedule (beta 0.00085..0.012, 1000 steps): only used to noise the latents.
        betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, device=self.device, dtype=torch.float64) ** 2
        self.alphas_cumprod = torch.cumprod(1 - betas, 0).float()
        return unet

    def build_text_encoders(self) -> None:
        from transformers import (
            CLIPTextConfig,
            CLIPTextModel,
            CLIPTextModelWithProjection,
        )

        te1, te2 = self.spec["text"]
        self.encoders["text_encoder"] = frozen_bf16(CLIPTextModel(CLIPTextConfig(**te1)))
        self.encoders["text_encoder_2"] = frozen_bf16(CLIPTextModelWithProjection(CLIPTextConfig(**te2)))

    def time_ids(self, batch: int):
        import torch

        px = self.spec["image_px"]  # original size, crop top-left, target size
        return torch.tensor([[px, px, 0, 0, px, px]] * batch, device=self.device, dtype=torch.bfloat16)

    def cached_inputs(self, batch: int) -> dict:
        import torch

        g = torch.Generator(self.device).manual_seed(batch)
        lat, net, (te1, te2) = self.spec["latent_px"], self.spec["net"], self.spec["text"]
        return {"latents": torch.randn(batch, net["in_channels"], lat, lat, device=self.device, generator=g),
                "hidden": torch.randn(batch, self.spec["tokens"][0], te1["hidden_size"] + te2["hidden_size"],
                                      device=self.device, generator=g).to(torch.bfloat16),
                "pooled": torch.randn(batch, te2["projection_dim"], device=self.device, generator=g).to(torch.bfloat16)}

    def encode_images(self, raw: dict):
        vae = self.encoders["vae"]
        return vae.encode(raw["images"]).latent_dist.sample().float() * vae.config.scaling_factor

    def encode_text(self, raw: dict) -> dict:
        import torch

        # As StableDiffusionXLPipeline.encode_prompt: both encoders' penultimate hidden states, concatenated, and
        # the second encoder's projected pooled output.
        out1 = self.encoders["text_encoder"](raw["ids0"], output_hidden_states=True)
        out2 = self.encoders["text_encoder_2"](raw["ids1"], output_hidden_states=True)
        hidden = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], dim=-1)
        return {"hidden": hidden.to(torch.bfloat16), "pooled": out2.text_embeds.to(torch.bfloat16)}

    def loss(self, x: dict):
        import torch
        import torch.nn.functional as F

        latents = x["latents"]
        b = latents.shape[0]
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (b,), device=latents.device)
        a = self.alphas_cumprod[t].view(b, 1, 1, 1)
        noisy = a.sqrt() * latents + (1 - a).sqrt() * noise
        added = {"text_embeds": x["pooled"], "time_ids": self.time_ids(b)}
        pred = self.net(noisy.to(torch.bfloat16), t, x["hidden"], added_cond_kwargs=added, return_dict=False)[0]
        return F.mse_loss(pred.float(), noise.float())


class FluxWorkload(Workload):
    name = "flux"

    def build_net(self):
        import torch
        from diffusers import FluxTransformer2DModel

        torch.manual_seed(0)
        with torch.device(self.device):
            net = frozen_bf16(FluxTransformer2DModel(**self.spec["net"]))
        store_base_weights(net, self.spec, self.device)
        lat = self.spec["latent_px"]
        # FluxPipeline._prepare_latent_image_ids: (H/2 * W/2, 3), channel 0 zero, then row and column; txt_ids are
        # zeros (T, 3). Both 2-D, as diffusers 0.42 expects.
        ids = torch.zeros(lat // 2, lat // 2, 3, device=self.device)
        ids[..., 1] = torch.arange(lat // 2, device=self.device)[:, None]
        ids[..., 2] = torch.arange(lat // 2, device=self.device)[None, :]
        self.img_ids = ids.reshape(-1, 3).to(torch.bfloat16)
        self.txt_ids = torch.zeros(self.spec["tokens"][1], 3, device=self.device, dtype=torch.bfloat16)
        return net

    def build_text_encoders(self) -> None:
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        clip, t5 = self.spec["text"]
        self.encoders["text_encoder"] = frozen_bf16(CLIPTextModel(CLIPTextConfig(**clip)))
        self.encoders["text_encoder_2"] = frozen_bf16(T5EncoderModel(T5Config(**t5)))

    def cached_inputs(self, batch: int) -> dict:
        import torch

        g = torch.Generator(self.device).manual_seed(batch)
        lat, (clip, t5) = self.spec["latent_px"], self.spec["text"]
        channels = self.spec["vae"]["latent_channels"]
        return {"latents": torch.randn(batch, channels, lat, lat, device=self.device, generator=g),
                "embeds": torch.randn(batch, self.spec["tokens"][1], t5["d_model"], device=self.device,
                                      generator=g).to(torch.bfloat16),
                "pooled": torch.randn(batch, clip["hidden_size"], device=self.device, generator=g).to(torch.bfloat16)}

    def encode_images(self, raw: dict):
        vae = self.encoders["vae"]
        latents = vae.encode(raw["images"]).latent_dist.sample().float()
        return (latents - vae.config.shift_factor) * vae.config.scaling_factor

    def encode_text(self, raw: dict) -> dict:
        import torch

        # As FluxPipeline.encode_prompt: CLIP's pooled output, T5's last hidden state.
        pooled = self.encoders["text_encoder"](raw["ids0"], output_hidden_states=False).pooler_output
        embeds = self.encoders["text_encoder_2"](raw["ids1"], output_hidden_states=False)[0]
        return {"embeds": embeds.to(torch.bfloat16), "pooled": pooled.to(torch.bfloat16)}

    @staticmethod
    def pack(x):
        b, c, h, w = x.shape  # FluxPipeline._pack_latents: (B, C, H, W) -> (B, H/2 * W/2, 4C)
        return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)

    @staticmethod
    def unpack(x, h: int, w: int):
        b, _, d = x.shape
        return x.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, d // 4, h, w)

    def loss(self, x: dict):
        import torch
        import torch.nn.functional as F

        latents = x["latents"]
        b, _, h, w = latents.shape
        noise = torch.randn_like(latents)
        sigmas = torch.sigmoid(torch.randn(b, device=latents.device))  # logit-normal
        s = sigmas.view(b, 1, 1, 1)
        noisy = ((1 - s) * latents + s * noise).to(torch.bfloat16)
        guidance = torch.full((b,), self.spec["guidance"], device=latents.device, dtype=torch.float32)
        packed = self.net(hidden_states=self.pack(noisy), timestep=sigmas.to(torch.bfloat16), guidance=guidance,
                          pooled_projections=x["pooled"], encoder_hidden_states=x["embeds"], txt_ids=self.txt_ids,
                          img_ids=self.img_ids, return_dict=False)[0]
        return F.mse_loss(self.unpack(packed, h, w).float(), (noise - latents).float())


WORKLOADS = {"sdxl": SDXLWorkload, "flux": FluxWorkload}


# ---- training and measuring -------------------------------------------------------------------------------------


def train_step(w: Workload, optimizer, x: dict, *, cached: bool) -> None:
    import torch

    with torch.autocast(w.device.type, dtype=torch.bfloat16):
        if not cached:
            with torch.no_grad():
                x = w.encode(x)
        loss = w.loss(x)
    loss.backward()
    if optimizer is not None:
        torch.nn.utils.clip_grad_norm_(w.params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def count_flops(fn, backends) -> int:
    """FLOPs of fn() under FlopCounterMode, attention restricted to `backends`."""
    from torch.nn.attention import sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with sdpa_kernel(backends), counter:
        fn()
    return counter.get_total_flops()


def encoder_flops(w: Workload, backends) -> dict:
    """FLOPs of the frozen encoders (VAE encoder; text encoders) for one sample, as an uncached step runs them."""
    import torch

    raw = w.raw_inputs(1)
    out = {}
    for key, part in (("vae_encoder", w.encode_images), ("text_encoders", w.encode_text)):
        def run(part=part):
            with torch.no_grad(), torch.autocast(w.device.type, dtype=torch.bfloat16):
                part(raw)

        out[key] = count_flops(run, backends)
    return out


def gflops(flops: float) -> str:
    value = flops / 1e9
    return f"{value:,.1f}" if value >= 10 else f"{value:.3g}"  # the dry run's tiny models: a few MFLOPs


def free(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(w: Workload, *, batch: int, cached: bool, checkpointing: bool, steps: int, warmup: int) -> dict:
    import torch

    w.set_checkpointing(checkpointing)
    device = w.device
    cuda = device.type == "cuda"
    optimizer = x = result = None
    try:
        free(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        x = w.cached_inputs(batch) if cached else w.raw_inputs(batch)
        optimizer = torch.optim.AdamW(w.params, lr=1e-6, weight_decay=1e-2)  # the engine's optimizer (default impl)
        began = time.perf_counter()
        for _ in range(warmup):  # with --compile, the blocks compile for this configuration's shapes here
            train_step(w, optimizer, x, cached=cached)
        if cuda:
            torch.cuda.synchronize()
        warmup_s = time.perf_counter() - began
        start = time.perf_counter()
        for _ in range(steps):
            train_step(w, optimizer, x, cached=cached)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        result = {"status": "ok", "step_ms": 1000 * seconds / steps, "samples_per_s": batch * steps / seconds,
                  "peak_mb": peak, "warmup_s": warmup_s}
    except torch.OutOfMemoryError:
        result = {"status": "OOM"}  # cleaned up below, once the exception (and the frames it holds) is gone
    for p in w.params:
        p.grad = None
    del optimizer, x
    free(device)
    return result


def plan(spec: dict, batches: list[int]) -> list[tuple[bool, bool, int]]:
    """(cached, gradient checkpointing, batch) in the order they run: cached first (the encoders are built only for
    the uncached ones), each row's batches ascending."""
    checkpointing = (True,) if spec.get("block_swap") else (False, True)  # block swap needs it, as in the engine
    return [(cached, gc_on, b) for cached in (True, False) for gc_on in checkpointing for b in batches]


def row_label(r: dict) -> str:
    return (f"{r['model']:4s} {'cached  ' if r['cached'] else 'uncached'} gc={'on ' if r['gradient_checkpointing'] else 'off'}"
            f" batch {r['batch']}")


def run_model(name: str, spec: dict, *, device, lora_rank: int, batches: list[int], steps: int,
              warmup: int, peak: float | None, deadline: float, budget_note: str, results: list, info: dict) -> None:
    """Builds the model, counts its FLOPs and measures every configuration, appending rows to `results` as they
    are measured and facts to `info` as they are known (so that a failure midway keeps what was done)."""
    import torch
    from torch.nn.attention import SDPBackend

    t0 = time.perf_counter()
    w = WORKLOADS[name](spec, device, lora_rank)
    info.update(parameters=w.net_params, lora_parameters=sum(p.numel() for p in w.params), lora_layers=w.lora_layers,
                build_s=time.perf_counter() - t0)
    print(f"{spec['label']}: {w.net_params / 1e6:,.1f} M parameters, built in {info['build_s']:.1f} s; LoRA rank "
          f"{lora_rank} on {w.lora_layers} layers, {info['lora_parameters'] / 1e6:.2f} M trainable parameters", flush=True)

    # FLOPs at batch 1. Attention through the math path (plain matmuls, counted whatever the fused kernels'
    # registrations are), except FLUX's forward + backward on the GPU: the math path would keep 57 layers x 24
    # heads x 4608^2 attention probabilities for the backward (> 100 GB), so that one uses the fused kernels, which
    # FlopCounterMode counts with the same formulas (4 b h s^2 d forward, 8 b h s^2 d backward); the forward is
    # counted both ways as a check.
    math = [SDPBackend.MATH]
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    t0 = time.perf_counter()
    x1 = w.cached_inputs(1)

    def forward():
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            w.loss(x1)

    w.set_checkpointing(False)
    info["forward_flops"] = count_flops(forward, math)

    def train():
        train_step(w, None, x1, cached=True)

    if name == "flux" and device.type == "cuda":
        try:
            info["forward_flops_fused_attention"] = count_flops(forward, fused)
            info["train_flops"] = count_flops(train, fused)
            info["train_flops_attention"] = "fused"
        except RuntimeError as exc:  # no fused kernel for these inputs, or out of memory
            print(f"  (fused-attention count failed: {type(exc).__name__}: {str(exc)[:200]}; counting with the "
                  "math path under gradient checkpointing, minus the recomputed forward)", flush=True)
    if "train_flops" not in info:
        try:
            if name == "flux" and device.type == "cuda":
                for p in w.params:
                    p.grad = None
                free(device)
                w.set_checkpointing(True)
                info["train_flops"] = count_flops(train, math) - info["forward_flops"]
                info["train_flops_attention"] = "math, checkpointed, minus one forward (approximate)"
            else:
                info["train_flops"] = count_flops(train, math)
                info["train_flops_attention"] = "math"
        except RuntimeError as exc:
            info["train_flops"] = None
            print(f"  (forward + backward count failed: {type(exc).__name__}: {str(exc)[:200]}; no MFU counted)",
                  flush=True)
        w.set_checkpointing(False)
    for p in w.params:
        p.grad = None
    x1 = None  # frees the inputs (the closures above hold the name, not the tensors)
    free(device)
    print(f"  forward at batch 1: {gflops(info['forward_flops'])} GFLOPs"
          + (f" (fused attention: {gflops(info['forward_flops_fused_attention'])})"
             if "forward_flops_fused_attention" in info else "")
          + (f"; forward + backward with LoRA: {gflops(info['train_flops'])} GFLOPs "
             f"({info['train_flops'] / info['forward_flops']:.2f}x forward, attention {info['train_flops_attention']})"
             if info["train_flops"] else "")
          + f"; counted in {time.perf_counter() - t0:.1f} s", flush=True)

    if spec.get("compile"):  # after the FLOP counts, which run eagerly
        info["compiled_blocks"] = compile_repeated_blocks(w.net)
        print(f"  train.compile: {info['compiled_blocks']} repeated blocks compiled in place (regional, static "
              "shapes); each configuration's warm-up compiles them for its shapes", flush=True)
    oom_at: dict = {}
    for cached, checkpointing, batch in plan(spec, batches):
        row = {"model": name, "cached": cached, "gradient_checkpointing": checkpointing, "batch": batch}
        key = (cached, checkpointing)
        if key in oom_at and batch > oom_at[key]:
            row.update(status="skipped", reason=f"OOM at batch {oom_at[key]}")
        elif time.perf_counter() > deadline:
            row.update(status="skipped", reason=budget_note)
        else:
            if not cached and not w.encoders:
                t0 = time.perf_counter()
                w.build_encoders()
                info["encoder_parameters"] = w.encoder_params()
                info["encoder_flops"] = encoder_flops(w, math)
                free(device)
                total = sum(info["encoder_flops"].values())
                print("  frozen encoders (uncached configurations): "
                      + ", ".join(f"{k} {v / 1e6:,.1f} M" for k, v in info["encoder_parameters"].items())
                      + f" parameters; per sample: VAE encoder {gflops(info['encoder_flops']['vae_encoder'])} + "
                      f"text encoders {gflops(info['encoder_flops']['text_encoders'])} = {gflops(total)} GFLOPs "
                      f"(not counted in MFU); built and counted in {time.perf_counter() - t0:.1f} s", flush=True)
            row.update(measure(w, batch=batch, cached=cached, checkpointing=checkpointing, steps=steps, warmup=warmup))
            if row["status"] == "OOM":
                oom_at[key] = batch
        if row["status"] == "ok" and peak:
            useful = row["samples_per_s"] * 1e-12
            row["mfu_3x"] = 3 * info["forward_flops"] * useful / peak
            if info["train_flops"]:
                row["mfu_counted"] = info["train_flops"] * useful / peak
        results.append(row)
        print(f"  {row_label(row)}: {row['status']}"
              + (f"  {row['samples_per_s']:.2f} samples/s  {row['step_ms']:.1f} ms/step  peak "
                 f"{fmt(row['peak_mb'], 0)} MB" + (f"  MFU 3x {100 * row['mfu_3x']:.1f}%  counted "
                                                    f"{100 * row['mfu_counted']:.1f}%" if "mfu_3x" in row else "")
                 if row["status"] == "ok" else f" ({row.get('reason', '')})"), flush=True)
    w.drop_encoders()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "gpu_large.json"), help="JSON results file")
    p.add_argument("--models", default="sdxl,flux", help="comma-separated: sdxl, flux (run in this order)")
    p.add_argument("--sdxl-batches", default=None, help="comma-separated batch sizes (default 1,2,4; dry run 1,2)")
    p.add_argument("--flux-batches", default=None, help="comma-separated batch sizes (default 1,2)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per configuration (default SDXL 10, FLUX 8; dry run 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per configuration (default 2; dry run 1)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--base-weights", choices=("bf16", "fp8", "fp8-compute", "nf4"), default="bf16",
                   help="how the frozen network is stored, as model.base_weights (fp8: diffusers' layerwise casting; "
                        "fp8-compute: fp8 with model.fp8_compute on, the Linear layers multiplied by "
                        "torch._scaled_mm, needs compute capability 8.9+; nf4: torchao's NF4Tensor); one storage "
                        "per invocation, give each its own --out")
    p.add_argument("--block-swap", type=int, default=0,
                   help="model.block_swap: the last N transformer blocks' frozen weights in pinned CPU memory, copied "
                        "in per call with a side-stream prefetch (FLUX only; with gradient checkpointing only); "
                        "bench/block_swap.md")
    p.add_argument("--compile", action="store_true",
                   help="train.compile: the network's repeated blocks compiled in place (regional, static shapes) "
                        "before the measurements; each configuration's warm-up compiles its shapes")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's peak dense bf16 TFLOP/s, when its name is not in gpu_sd15.py's table")
    p.add_argument("--time-budget", type=float, default=330.0,
                   help="seconds from the start; configurations not started by then are skipped (and listed)")
    p.add_argument("--cudnn-attention", action="store_true",
                   help="let SDPA use cuDNN's fused attention (off by default, as in the engine: its FLUX backward "
                        "hit an illegal memory access on an H200 with torch 2.11 / cuDNN 9.19)")
    p.add_argument("--dry-run-cpu", action="store_true",
                   help="run the same code on tiny versions of every model on the CPU to check the script works")
    args = p.parse_args(argv)
    t_begin = time.perf_counter()

    import torch

    dry = args.dry_run_cpu
    if not dry and not torch.cuda.is_available():
        print("error: bench/gpu_large.py needs a CUDA GPU and none is visible here (torch.cuda.is_available() is "
              "False). Run it on a machine with a GPU, or use --dry-run-cpu to check the script on the CPU.",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if dry else "cuda")
    if dry and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # a shared CPU: see gpu_sd15.py; the dry run's numbers mean nothing anyway
    if not args.cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)  # flash / memory-efficient attention, as trainer.engine.worker does
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or set(models) - set(MODELS):
        p.error(f"--models takes some of {', '.join(MODELS)}")
    batch_args = {"sdxl": args.sdxl_batches, "flux": args.flux_batches}

    gpu = "CPU (dry run)" if dry else torch.cuda.get_device_name()
    peak = args.peak_tflops or (None if dry else peak_tflops_for(gpu))
    notes = []
    if peak is None and not dry:
        notes.append(f"'{gpu}' is not in the peak-FLOP table: pass --peak-tflops for MFU")
    print(f"device: {gpu}; peak dense bf16: {fmt(peak, 0)} TFLOP/s; torch {torch.__version__}; "
          f"time budget {args.time_budget:.0f} s", flush=True)

    budget_end = t_begin + args.time_budget
    results, infos, errors = [], {}, {}
    for k, name in enumerate(models):
        spec = model_spec(name, dry)
        spec["base_weights"] = args.base_weights
        spec["compile"] = args.compile
        spec["block_swap"] = args.block_swap if name == "flux" else 0
        batches = [int(b) for b in (batch_args[name] or ("1,2" if dry else ",".join(map(str, spec["batches"])))).split(",")]
        steps = args.steps or (1 if dry else spec["steps"])
        warmup = args.warmup if args.warmup is not None else (1 if dry else spec["warmup"])
        now = time.perf_counter()
        # An equal share of what is left, so the first model cannot use up the second one's time.
        deadline = now + max(0.0, budget_end - now) / (len(models) - k)
        note = (f"past --time-budget {args.time_budget:.0f} s" if k == len(models) - 1 or now > budget_end
                else f"past this model's share of --time-budget ({deadline - t_begin:.0f} s of {args.time_budget:.0f} s)")
        info = infos[name] = {"label": spec["label"], "config": spec["net"], "vae_config": spec["vae"],
                              "text_encoder_configs": spec["text"], "text_tokens": spec["tokens"],
                              "lora_targets": spec["targets"], "image_px": spec["image_px"],
                              "latent_px": spec["latent_px"], "batches": batches, "steps": steps, "warmup": warmup,
                              "base_weights": args.base_weights, "compile": args.compile,
                              "block_swap": spec["block_swap"]}
        print(f"\n== {name}: {spec['label']}, {spec['image_px']} px, base weights {args.base_weights}; batches "
              f"{batches}; {warmup} warm-up + {steps} "
              f"timed steps per configuration; starts at {now - t_begin:.0f} s, share until "
              f"{deadline - t_begin:.0f} s", flush=True)
        done = len(results)
        if now > budget_end:
            pass  # every configuration is listed as skipped below, without building the model
        else:
            try:
                run_model(name, spec, device=device, lora_rank=args.lora_rank, batches=batches, steps=steps,
                          warmup=warmup, peak=peak, deadline=deadline, budget_note=note, results=results, info=info)
            except Exception as exc:  # noqa: BLE001  (one model's failure must not lose the other's results)
                errors[name] = f"{type(exc).__name__}: {exc}"
                print(f"error: {name} failed: {errors[name]}", file=sys.stderr, flush=True)
                traceback.print_exc()
        measured = {(r["cached"], r["gradient_checkpointing"], r["batch"]) for r in results[done:]}
        for cached, checkpointing, batch in plan(spec, batches):
            if (cached, checkpointing, batch) not in measured:
                reason = f"{name} failed: {errors[name]}"[:200] if name in errors else note
                results.append({"model": name, "cached": cached, "gradient_checkpointing": checkpointing,
                                "batch": batch, "status": "error" if name in errors else "skipped", "reason": reason})
                print(f"  {row_label(results[-1])}: {results[-1]['status']} ({reason})", flush=True)
        info["elapsed_s"] = time.perf_counter() - now
        free(device)  # the model's objects went with run_model's frame (and the exception's, if any)
        if device.type == "cuda":
            info["memory_left_allocated_mb"] = torch.cuda.memory_allocated() / 2**20

    headers = ["model", "text + VAE", "grad ckpt", "batch", "samples/s", "step ms", "peak memory MB", "MFU 3x",
               "MFU counted"]
    rows = []
    for r in results:
        head = [r["model"], "cached" if r["cached"] else "encoded each step",
                "on" if r["gradient_checkpointing"] else "off", r["batch"]]
        if r["status"] == "ok":
            rows.append(head + [fmt(r["samples_per_s"], 2), fmt(r["step_ms"], 1), fmt(r["peak_mb"], 0),
                                f"{100 * r['mfu_3x']:.1f}%" if "mfu_3x" in r else "-",
                                f"{100 * r['mfu_counted']:.1f}%" if "mfu_counted" in r else "-"])
        else:
            rows.append(head + [r["status"] + (f" ({r['reason']})" if r.get("reason") else ""), "-", "-", "-", "-"])
    table = markdown_table(headers, rows)
    elapsed = time.perf_counter() - t_begin
    parts = []
    for name, info in infos.items():
        part = f"{info['label']}: "
        if "forward_flops" in info:
            enc, train = info.get("encoder_flops"), info.get("train_flops")
            part += (f"{info['parameters'] / 1e6:,.1f} M params (LoRA {info['lora_parameters'] / 1e6:.2f} M on "
                     f"{info['lora_layers']} layers), forward {gflops(info['forward_flops'])} GFLOPs/sample, "
                     + (f"counted fwd+bwd {gflops(train)} ({train / info['forward_flops']:.2f}x)" if train
                        else "fwd+bwd not counted")
                     + (f", frozen encoders {gflops(sum(enc.values()))} GFLOPs/sample (not in MFU)" if enc else ""))
            part += f" (then failed: {errors[name]})" if name in errors else ""
        else:
            part += f"failed ({errors[name]})" if name in errors else "not run"
        parts.append(part)
    summary = (f"{gpu}, peak {fmt(peak, 0)} TFLOP/s bf16 dense; {'tiny models (dry run)' if dry else '1024 px'}; "
               + "; ".join(parts) + f"; {elapsed:.0f} s in all")
    print()
    print(table)
    print()
    print(summary)
    if dry:
        notes.append("dry run on the CPU with tiny models: checks the script, the numbers mean nothing "
                     f"(peak memory is not measured on the CPU; process max RSS {max_rss_mb():.0f} MB)")
    for name, err in errors.items():
        notes.append(f"{name} failed: {err}")
    for note in notes:
        print(f"note: {note}")
    out = {
        "device": gpu, "peak_bf16_tflops": peak, "dry_run_cpu": dry, "torch": torch.__version__,
        "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if not dry else None,
        "versions": _versions(), "lora_rank": args.lora_rank, "time_budget_s": args.time_budget,
        "models": infos, "results": results, "table": table, "summary": summary, "notes": notes,
        "errors": errors, "elapsed_s": elapsed,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("diffusers", "transformers", "peft", "accelerate"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
