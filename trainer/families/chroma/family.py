"""Chroma (lodestones/Chroma1-HD, Chroma1-Base): a FLUX.1-schnell transformer pruned to 8.9B parameters, with T5-XXL
as its only text encoder, no guidance embedding (a small "distilled guidance layer" computes every block's
modulation from the timestep) and real classifier-free guidance at sampling.

Everything is as diffusers' ChromaPipeline (pipelines/chroma/pipeline_chroma.py, diffusers 0.42) draws an image:
- text: T5 with the tokenizer's mask (lines 239-244), padded to `flow.max_sequence_length` (512, line 614), and a
  mask for the transformer that keeps the real tokens and the first padding token (lines 248-251), extended with
  ones for the image tokens (`_prepare_attention_mask`, lines 545-561); text ids are zeros (line 323);
- the transformer takes the packed 2x2 latent tokens and the timestep as sigma (`timestep / 1000`, line 860);
- the shift is the scheduler's: FLUX's resolution-dependent exp(mu) when its dynamic shifting is on, else its
  static shift (lines 777-785).
Training draws sigma logit-normally and regresses the velocity noise - x0, as ai-toolkit's Chroma trainer does
(extensions_built_in/diffusion_models/chroma/chroma_model.py:441-444) and SimpleTuner's (helpers/models/chroma).
LoRA goes on the attention projections and MLPs of both kinds of blocks, never on the distilled guidance layer
(ComfyUI maps no LoRA key onto it, and ai-toolkit runs it without gradients).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import ChromaPipeline

from trainer.families.components import flow_matching as fm
from trainer.families.components.transfer import on_device
from trainer.families.flow import flux_layout
from trainer.families.flow.family import FlowFamily

class ChromaFamily(FlowFamily):
    """Chroma: the flow-matching core (FlowFamily) with Chroma's hooks."""

    name = "chroma"
    pipeline_class = ChromaPipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    t5_name = "text_encoder"

    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return flux_layout.lora_targets(self.cfg.flow.lora_blocks)

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 512

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, _, mask, *_ = self.flow.pipe.encode_prompt(caption, device=self.flow.text_device,
                                                           do_classifier_free_guidance=False,
                                                           max_sequence_length=self.max_sequence_length())
        return {"embeds": embeds.float(), "mask": mask.float()}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.scheduler_shift(latent_shape)

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        b, _, h, w = noisy.shape
        device, dtype = noisy.device, noisy.dtype
        embeds = on_device(text["embeds"], device, dtype)
        image_tokens = torch.ones(b, (h // 2) * (w // 2), device=device, dtype=dtype)
        mask = torch.cat([on_device(text["mask"], device, dtype), image_tokens], dim=1)
        packed = model(hidden_states=fm.pack_latents(noisy), timestep=sigmas, encoder_hidden_states=embeds,
                       txt_ids=torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
                       img_ids=on_device(fm.latent_image_ids(h, w), device, dtype), attention_mask=mask,
                       return_dict=False)[0]
        return fm.unpack_latents(packed, h, w)

    def checkpointing_func(self, transformer: Any) -> Any:
        """diffusers' checkpointing, with the attention mask its single blocks lose. Under gradient checkpointing
        ChromaTransformer2DModel calls them as `(block, hidden_states, temb, image_rotary_emb)`, without
        `attention_mask` (diffusers 0.42, transformer_chroma.py lines 587-592; lines 598-603 pass it): a training
        step with checkpointing attended to the caption's padding tokens that sampling masks (step-1 loss of the
        tiny model 1.55320 against 1.55228). The mask is the one the transformer's forward was given."""
        import functools

        import torch.utils.checkpoint

        given: dict[str, Any] = {}

        def keep_mask(module: Any, args: tuple, kwargs: dict) -> None:
            given["mask"] = kwargs.get("attention_mask")

        transformer.register_forward_pre_hook(keep_mask, with_kwargs=True)
        single = {id(block) for block in transformer.single_transformer_blocks}

        def checkpointed(block: Any, *args: Any) -> Any:
            call = block.__call__
            if id(block) in single and len(args) == 3:  # no mask among them: pass it by name
                call = functools.partial(block.__call__, attention_mask=given["mask"])
            return torch.utils.checkpoint.checkpoint(call, *args, use_reentrant=False)

        return checkpointed

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt, negative_prompt or ""]  # real guidance: the pipeline encodes "" without a negative prompt

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length(), "negative_prompt": negative_prompt or None}

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        text, negative = self.flow.cached(prompt), self.flow.cached(negative_prompt or "")
        return {"prompt_embeds": text["embeds"], "prompt_attention_mask": text["mask"],
                "negative_prompt_embeds": negative["embeds"], "negative_prompt_attention_mask": negative["mask"]}

    # ---- exports ------------------------------------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """FLUX.1's fused BFL names: ComfyUI's Chroma is its Flux model (comfy/model_base.py `class Chroma(Flux)`),
        whose LoRA key map names every `diffusion_model.double_blocks...` / `single_blocks...` weight as
        `lora_unet_<path>` (comfy/lora.py, model_lora_keys_unet)."""
        from trainer.families.flow.kohya_flux import transformer_to_kohya

        return transformer_to_kohya(state, alphas, transformer)

    def kohya_metadata(self) -> dict[str, str]:
        return {"ss_base_model_version": "chroma", "ss_v2": "False", "modelspec.architecture": "chroma/lora",
                "modelspec.implementation": "https://huggingface.co/lodestones/Chroma1-HD",
                "modelspec.prediction_type": "flow"}

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        """The transformer alone in lodestones' layout (as Chroma1-HD.safetensors; trainer.families.chroma
        .checkpoint): ComfyUI's "Load Diffusion Model", or ChromaTransformer2DModel.from_single_file."""
        from trainer.families.chroma.checkpoint import save_chroma_single_file

        return save_chroma_single_file(transformer, path, metadata=metadata)
