"""FLUX.1 dev and schnell: LoRA on the transformer, trained by flow matching on packed latents.

The transformer sees the VAE latent (16 channels, shifted and scaled) as 2x2-packed tokens with position ids,
the T5 hidden states (plus zero text ids), CLIP's pooled embedding, the timestep sigma and, for dev (the model
has a guidance embedding), the distilled guidance value `flow.guidance`. Timesteps: logit-normal by default,
shifted by FLUX's resolution-dependent shift (exp(mu), mu linear in the image token count) unless `flow.shift`
is set; schnell (no dynamic shifting in its scheduler) uses its scheduler's shift, 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import FluxPipeline

from trainer.families.components import flow_matching as fm
from trainer.families.components.transfer import on_device
from trainer.families.flow import flux_layout
from trainer.families.flow.family import FlowFamily

class FluxFamily(FlowFamily):
    """FLUX.1: the flow-matching core (FlowFamily) with FLUX's hooks."""

    name = "flux"
    pipeline_class = FluxPipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder", "text_encoder_2")
    t5_name = "text_encoder_2"

    # ---- FlowModel: what the trainer asks of FLUX ---------------------------------------------------------
    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return flux_layout.lora_targets(self.cfg.flow.lora_blocks)

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.flow.transformer.config.guidance_embeds)

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or (512 if self.guidance_embeds else 256)

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.flow.pipe.encode_prompt(caption, prompt_2=None, device=self.flow.text_device,
                                                         max_sequence_length=self.max_sequence_length())
        return {"embeds": embeds.float(), "pooled": pooled.float()}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.scheduler_shift(latent_shape)

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        b, _, h, w = noisy.shape
        device, dtype = noisy.device, noisy.dtype
        embeds = on_device(text["embeds"], device, dtype)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), float(self.cfg.flow.guidance), device=device, dtype=torch.float32)
        packed = model(hidden_states=fm.pack_latents(noisy), timestep=sigmas, guidance=guidance,
                       pooled_projections=on_device(text["pooled"], device, dtype), encoder_hidden_states=embeds,
                       txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
                       img_ids=on_device(fm.latent_image_ids(h, w), device, dtype), return_dict=False)[0]
        return fm.unpack_latents(packed, h, w)

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt]

    def sample_kwargs(self, negative_prompt: str) -> dict:
        # FLUX has no classic negative prompt (dev's guidance is distilled); schnell ignores guidance_scale.
        return {"max_sequence_length": self.max_sequence_length()}

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        text = self.flow.cached(prompt)
        return {"prompt_embeds": text["embeds"], "pooled_prompt_embeds": text["pooled"]}

    # ---- exports ------------------------------------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The fused BFL names every FLUX reader knows (ComfyUI, Forge: trainer.families.flow.kohya_flux)."""
        from trainer.families.flow.kohya_flux import transformer_to_kohya

        return transformer_to_kohya(state, alphas, transformer)

    def kohya_metadata(self) -> dict[str, str]:
        from trainer.families.flow.kohya_flux import flux_metadata_overrides

        return flux_metadata_overrides(guidance_embeds=self.guidance_embeds)

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        """The transformer alone in Black Forest Labs' layout (as flux1-dev.safetensors)."""
        from trainer.families.flow.flux_checkpoint import save_flux_single_file

        return save_flux_single_file(transformer, path, metadata=metadata)
