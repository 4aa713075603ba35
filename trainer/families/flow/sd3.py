"""Stable Diffusion 3 / 3.5: LoRA on the MMDiT transformer, trained by flow matching.

Conditioning as in StableDiffusion3Pipeline: CLIP-L and CLIP-G penultimate hidden states concatenated, padded
to T5's width and joined with T5's tokens; pooled = both CLIPs' projected embeddings. Timesteps: logit-normal
by default, shifted by the scheduler's shift (3.0 for SD3/3.5) unless `flow.shift` is set; the transformer
takes `sigma * 1000`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline

from trainer.families.components.transfer import on_device
from trainer.families.flow.family import FlowFamily

TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


class SD3Family(FlowFamily):
    """SD3/3.5: the flow-matching core (FlowFamily) with SD3's hooks."""

    name = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    t5_name = "text_encoder_3"

    # ---- FlowModel: what the trainer asks of SD3 ----------------------------------------------------------
    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return {"transformer_blocks": TARGETS}

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 256

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.flow.pipe.encode_prompt(caption, None, None, device=self.flow.text_device,
                                                            do_classifier_free_guidance=False,
                                                            max_sequence_length=self.max_sequence_length())
        return {"embeds": embeds.float(), "pooled": pooled.float()}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.static_shift()

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        device, dtype = noisy.device, noisy.dtype
        return model(hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=on_device(text["embeds"], device, dtype),
                     pooled_projections=on_device(text["pooled"], device, dtype), return_dict=False)[0]

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length(), "negative_prompt": negative_prompt or None}

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt, negative_prompt or ""]  # the pipeline encodes "" when there is no negative prompt

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        text, negative = self.flow.cached(prompt), self.flow.cached(negative_prompt or "")
        return {"prompt_embeds": text["embeds"], "pooled_prompt_embeds": text["pooled"],
                "negative_prompt_embeds": negative["embeds"], "negative_pooled_prompt_embeds": negative["pooled"]}

    # ---- exports ------------------------------------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> None:
        return None  # ComfyUI reads SD3's diffusers LoRA file as it is

    def kohya_metadata(self) -> dict[str, str]:
        return {"ss_base_model_version": "sd3", "ss_v2": "False", "modelspec.prediction_type": "flow",
                "modelspec.architecture": "stable-diffusion-3/lora",
                "modelspec.implementation": "https://github.com/Stability-AI/sd3.5"}

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        """Stability's all-in-one layout: MMDiT + VAE + CLIP-L + CLIP-G + T5 (ComfyUI's "Load Checkpoint")."""
        from trainer.families.flow.sd3_checkpoint import COMPONENTS, save_sd3_single_file

        models = {name: getattr(self.flow.pipe, name, None) for name in COMPONENTS}
        return save_sd3_single_file({**models, "transformer": transformer}, path, metadata=metadata)
