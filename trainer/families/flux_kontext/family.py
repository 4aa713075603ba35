"""FLUX.1 Kontext (black-forest-labs/FLUX.1-Kontext-dev): FLUX.1 dev's transformer taught to edit an image as its
caption instructs, trained on pairs (data.control_path: each target's control image).

Everything is as diffusers' FluxKontextPipeline (pipelines/flux/pipeline_flux_kontext.py, diffusers 0.42) draws:
- the control image is VAE-encoded to its distribution's mode (`_encode_vae_image`, sample_mode="argmax", lines
  599-611: here the cached mean), shifted and scaled as the target (line 609), packed into 2x2 tokens (line 656)
  and appended after the noisy target's tokens in the image sequence (`torch.cat([latents, image_latents], dim=1)`,
  line 1038);
- its position ids are the target's grid with the first coordinate set to 1 (`image_ids[..., 0] = 1`, lines
  659-663), appended after the target's ids (line 962);
- the prediction is read at the target's tokens only (`noise_pred[:, : latents.size(1)]`, line 1052), so the loss
  is on the target's tokens;
- the shift is FLUX's exp(mu) of the target's token count alone (`image_seq_len = latents.shape[1]`, line 966,
  before the control is appended), the guidance embedding takes `flow.guidance` as FLUX.1 dev's (lines 985-987),
  text and timestep as FLUX.1 (FLUX.1-Kontext-dev has FLUX.1-dev's encoders and scheduler).
ai-toolkit's Kontext trainer does the same (extensions_built_in/diffusion_models/flux_kontext: control latents
concatenated after the packed noisy latents, ids with 1 in the first coordinate, prediction cut to the target's
tokens). The control gets its target's bucket, crop and flip (CaptionedLatents); samples edit the control image of
the first training image (`sample_image_kwargs`). Outputs are FLUX.1's: the same transformer, the same ComfyUI
layout (ComfyUI loads Kontext as its Flux model, comfy/model_base.py `Flux` with its `ref_latents`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from trainer.families.components import flow_matching as fm
from trainer.families.components.transfer import on_device
from trainer.families.flow import flux_layout
from trainer.families.flow.family import FlowFamily


def control_image_ids(height: int, width: int) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of a control image's packed tokens: its own grid, first coordinate 1."""
    ids = fm.latent_image_ids(height, width)
    ids[:, 0] = 1
    return ids


class FluxKontextFamily(FlowFamily):
    """FLUX.1 Kontext: the flow-matching core (FlowFamily) with FLUX.1's text, shift and exports (the shared FLUX
    parts: flux_layout, kohya_flux, flux_checkpoint) and the control image in the transformer's image sequence."""

    name = "flux_kontext"
    pipeline_class = FluxKontextPipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder", "text_encoder_2")
    t5_name = "text_encoder_2"

    # ---- FlowModel: FLUX.1 dev's text and shift (the same encoders and scheduler) ---------------------------
    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return flux_layout.lora_targets(self.cfg.flow.lora_blocks)

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.flow.transformer.config.guidance_embeds)

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 512  # FluxKontextPipeline's default (line 726)

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.flow.pipe.encode_prompt(caption, prompt_2=None, device=self.flow.text_device,
                                                         max_sequence_length=self.max_sequence_length())
        return {"embeds": embeds.float(), "pooled": pooled.float()}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.scheduler_shift(latent_shape)  # of the target's shape: the control adds no tokens to mu

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt]

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length()}  # distilled guidance: no negative prompt

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        text = self.flow.cached(prompt)
        return {"prompt_embeds": text["embeds"], "pooled_prompt_embeds": text["pooled"]}

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        b, _, h, w = noisy.shape
        device, dtype = noisy.device, noisy.dtype
        control = on_device(text["control"], device, dtype)
        ch, cw = control.shape[-2:]
        embeds = on_device(text["embeds"], device, dtype)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), float(self.cfg.flow.guidance), device=device, dtype=torch.float32)
        ids = torch.cat([fm.latent_image_ids(h, w), control_image_ids(ch, cw)])
        tokens = (h // 2) * (w // 2)
        text_ids = torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype)
        packed = model(hidden_states=torch.cat([fm.pack_latents(noisy), fm.pack_latents(control)], dim=1),
                       timestep=sigmas, guidance=guidance, pooled_projections=on_device(text["pooled"], device, dtype),
                       encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=on_device(ids, device, dtype),
                       return_dict=False)[0]
        return fm.unpack_latents(packed[:, :tokens], h, w)

    def sample_image_kwargs(self, width: int, height: int) -> dict:
        """The control image of the first training image at the sample's size. `max_area` is the sample's own and
        `_auto_resize` off: the pipeline otherwise scales both to about 1024² (FLUX.1 Kontext's preferred sizes,
        lines 844-847, 938-942), which is not the size this run trains its pairs at."""
        assert self.flow.data.control_paths is not None, "the config checks require data.control_path"
        with Image.open(self.flow.data.control_paths["instance"][0]) as opened:
            control = opened.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
        return {"image": control, "max_area": width * height, "_auto_resize": False}

    # ---- exports: FLUX.1's (the same transformer) ----------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        from trainer.families.flow.kohya_flux import transformer_to_kohya

        return transformer_to_kohya(state, alphas, transformer)

    def kohya_metadata(self) -> dict[str, str]:
        from trainer.families.flow.kohya_flux import flux_metadata_overrides

        return flux_metadata_overrides(guidance_embeds=self.guidance_embeds)

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        """The transformer alone in Black Forest Labs' layout (as flux1-kontext-dev.safetensors)."""
        from trainer.families.flow.flux_checkpoint import save_flux_single_file

        return save_flux_single_file(transformer, path, metadata=metadata)
