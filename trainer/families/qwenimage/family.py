"""Qwen-Image (Qwen/Qwen-Image and its 2512 release): a 20B MMDiT (60 two-stream blocks) over the latents of a
video-style 3D VAE, with Qwen2.5-VL's last hidden states as its text input.

Everything is as diffusers' QwenImagePipeline (pipelines/qwenimage/pipeline_qwenimage.py, diffusers 0.42) draws:
- text: the caption inside a chat template (line 175) through the tokenizer (padding=True, lines 201-203), the text
  encoder's last hidden state (line 209) at the real tokens (`_extract_masked_hidden`, lines 179-185), the first
  `prompt_template_encode_start_idx` = 34 tokens (the system prompt) dropped (lines 176, 211), zero-padded with
  a 0/1 mask (lines 212-220) that becomes None when it is all ones (lines 265-266); at most max_sequence_length
  tokens (512 at sampling, line 432; lines 255, 261). Cached captions are padded to `max_sequence_length()` and
  trimmed back to the batch's longest in `forward`: the transformer masks the padding out of the joint attention
  (transformer_qwenimage.py lines 506-509) and text RoPE positions count from the first token (lines 241-262), so
  a padded caption gives what the pipeline's unpadded one gives (tests/test_qwenimage.py);
- the transformer takes the 2x2-packed latent tokens (`_pack_latents`, lines 333-338: FLUX's packing), the
  timestep as sigma (`timestep / 1000`, lines 647, 660), the mask, and img_shapes [(1, h/2, w/2)] per image (line
  595); no guidance embedding (guidance_embeds=False);
- latents: the VAE works on (B, C, frames, H, W) and images are one frame ([:, :, 0] at decode, line 714); its
  latents are normalised per channel, (z - latents_mean) / latents_std (the inverse at lines 705-713);
- the shift: exp(mu) of the packed token count with the scheduler's base/max shift and sequence lengths (lines
  597-613; Qwen-Image's scheduler has max_shift 0.9 at 8192 tokens), `FlowTransformerTrainer.scheduler_shift`;
- true CFG: `true_cfg_scale` (not guidance_scale) with a negative prompt, and the guided prediction rescaled to
  the conditional one's norm (lines 564, 668-672); without a negative prompt nothing is guided, so samples use " ".
Training regresses the velocity noise - x0 with the sigma of the noisy input, as diffusers'
examples/dreambooth/train_dreambooth_lora_qwen_image.py (commit 58eb52c) does: one frame (`unsqueeze(2)`, line
959), the same normalisation (lines 1221-1222, 1737), the pipeline's call (lines 1763-1781), target noise - x0
(line 1790), weighting none (lines 563-565, 1787). That script draws timesteps uniformly and unshifted (lines
1746-1754, its scheduler has dynamic shifting on); here they are logit-normal with the pipeline's sampling shift
by default, as for FLUX and Chroma (`flow.timestep_sampling: uniform` and `flow.shift: 1` give the script's).
LoRA: the script's default is the image-stream attention projections (line 1284); here every attention projection
and MLP of both streams (img_mlp/txt_mlp), as the FLUX and Chroma defaults, except the last block's text stream,
which nothing reads (`lora_paths`); `flow.lora_targets` narrows it. ComfyUI: see components/qwen_image.py
`kohya_lora`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImagePipeline

from trainer.families.components import flow_matching as fm
from trainer.families.components import qwen_image
from trainer.families.components.qwen_image import BLOCK_TARGETS, ImageVAE
from trainer.families.components.transfer import on_device
from trainer.families.flow.family import FlowFamily

class QwenImageFamily(FlowFamily):
    """Qwen-Image: the flow-matching core (FlowFamily) with Qwen-Image's hooks."""

    name = "qwenimage"
    pipeline_class = QwenImagePipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    t5_name = "text_encoder"  # Qwen2.5-VL is a bf16 model: fp32 under fp16, as T5, rather than overflow

    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return {"transformer_blocks": BLOCK_TARGETS}  # one kind of block: flow.lora_blocks is refused (checks)

    def lora_paths(self, paths: list[str]) -> list[str]:
        return qwen_image.reaching_prediction(paths, self.flow.transformer.config.num_layers)

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 512

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        length = self.max_sequence_length()
        embeds, _ = self.flow.pipe.encode_prompt(caption, device=self.flow.text_device, max_sequence_length=length)
        n = embeds.shape[1]
        # Padded to one length so that captions stack in the cache; forward trims the padding back off.
        padded = torch.cat([embeds.float(), embeds.new_zeros(1, length - n, embeds.shape[2]).float()], dim=1)
        mask = torch.cat([torch.ones(1, n), torch.zeros(1, length - n)], dim=1).to(embeds.device)
        return {"embeds": padded, "mask": mask}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.scheduler_shift(latent_shape)

    # ---- the video VAE (FlowModel hooks with a 2D default in FlowFamily) -----------------------------------
    def image_vae(self, vae: Any) -> Any:
        return ImageVAE(vae)

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return qwen_image.normalize_latents(self.flow.vae.config, latents)

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        b, _, h, w = noisy.shape
        device, dtype = noisy.device, noisy.dtype
        mask = on_device(text["mask"], device)
        n = int(mask.sum(dim=1).max().item())  # the batch's longest caption, as the pipeline pads a batch
        embeds, mask = on_device(text["embeds"], device, dtype)[:, :n], mask[:, :n]
        packed = model(hidden_states=fm.pack_latents(noisy), timestep=sigmas.to(dtype), encoder_hidden_states=embeds,
                       encoder_hidden_states_mask=None if bool(mask.all()) else mask.bool(),
                       img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return fm.unpack_latents(packed, h, w)

    # ---- samples ------------------------------------------------------------------------------------------
    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt, negative_prompt or " "]  # " ": the pipeline guides only with a negative prompt (line 564)

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        return {"true_cfg_scale": guidance_scale}  # guidance_scale feeds a guidance embedding Qwen-Image lacks

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length(), "negative_prompt": negative_prompt or " "}

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        def trimmed(caption: str) -> tuple[torch.Tensor, torch.Tensor]:
            text = self.flow.cached(caption)
            n = int(text["mask"].sum().item())
            return text["embeds"][:, :n], text["mask"][:, :n].long()

        embeds, mask = trimmed(prompt)
        negative, negative_mask = trimmed(negative_prompt or " ")
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "negative_prompt_embeds": negative,
                "negative_prompt_embeds_mask": negative_mask}

    # ---- exports ------------------------------------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        return qwen_image.kohya_lora(state, alphas)  # lora_unet_<diffusers path>, with alphas (see there)

    def comfy_adapter_name(self, path: str) -> str:
        return qwen_image.comfy_name(path)

    def kohya_metadata(self) -> dict[str, str]:
        return qwen_image.kohya_metadata("qwen-image/lora", "https://huggingface.co/Qwen/Qwen-Image")

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        from trainer.errors import UserError

        # Qwen release Qwen-Image as a diffusers folder only (huggingface.co/Qwen/Qwen-Image: transformer/ shards and
        # config.json); ComfyUI's file (Comfy-Org's repackaging) keeps diffusers' names, which diffusers reads back
        # unchanged (single_file_model.py: QwenImageTransformer2DModel's mapping is the identity). The folder is the
        # release's own layout, and save_flow_full keeps it with this reason as a warning.
        raise UserError("Qwen-Image's original release is a diffusers folder (Qwen/Qwen-Image), so output/diffusers "
                        "is the model in its published layout: load it with QwenImagePipeline.from_pretrained; set "
                        "full.save_single_file=false to skip this note")
