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
  text and timestep as FLUX.1 (FluxFamily).
ai-toolkit's Kontext trainer does the same (extensions_built_in/diffusion_models/flux_kontext: control latents
concatenated after the packed noisy latents, ids with 1 in the first coordinate, prediction cut to the target's
tokens). The control gets its target's bucket, crop and flip (CaptionedLatents); samples edit the control image of
the first training image (`sample_image_kwargs`). Outputs are FLUX.1's: the same transformer, the same ComfyUI
layout (ComfyUI loads Kontext as its Flux model, comfy/model_base.py `Flux` with its `ref_latents`).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from trainer.families.components import flow_matching as fm
from trainer.families.components.transfer import on_device
from trainer.families.flow.flux import FluxFamily


def control_image_ids(height: int, width: int) -> torch.Tensor:
    """(H/2 * W/2, 3) position ids of a control image's packed tokens: its own grid, first coordinate 1."""
    ids = fm.latent_image_ids(height, width)
    ids[:, 0] = 1
    return ids


class FluxKontextFamily(FluxFamily):
    """FLUX.1 Kontext: FLUX.1's hooks (FluxFamily), with the control image in the transformer's image sequence."""

    name = "flux_kontext"
    pipeline_class = FluxKontextPipeline

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
        packed = model(hidden_states=torch.cat([fm.pack_latents(noisy), fm.pack_latents(control)], dim=1),
                       timestep=sigmas, guidance=guidance, pooled_projections=on_device(text["pooled"], device, dtype),
                       encoder_hidden_states=embeds, txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
                       img_ids=on_device(ids, device, dtype), return_dict=False)[0]
        return fm.unpack_latents(packed[:, :tokens], h, w)

    def sample_image_kwargs(self, width: int, height: int) -> dict:
        """The control image of the first training image at the sample's size. `max_area` is the sample's own and
        `_auto_resize` off: the pipeline otherwise scales both to about 1024² (FLUX.1 Kontext's preferred sizes,
        lines 844-847, 938-942), which is not the size this run trains its pairs at."""
        assert self.flow.data.control_paths is not None, "the config checks require data.control_path"
        with Image.open(self.flow.data.control_paths["instance"][0]) as opened:
            control = opened.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
        return {"image": control, "max_area": width * height, "_auto_resize": False}
