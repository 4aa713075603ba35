"""Z-Image (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image): a 6B single-stream transformer (text and image tokens in
one sequence after their own refiner blocks), with Qwen3-4B as its text encoder and FLUX.1's VAE.

Everything is as diffusers' ZImagePipeline (pipelines/z_image/pipeline_z_image.py, diffusers 0.42) draws an image:
- text: the caption wrapped in Qwen's chat template as one user message with the assistant prompt
  (`enable_thinking=True`, lines 217-227), padded to `flow.max_sequence_length` (512, line 320), encoded with the
  tokenizer's mask; the conditioning is the SECOND-TO-LAST hidden state (`hidden_states[-2]`, line 244) with the
  padding dropped (`prompt_embeds[i][prompt_masks[i]]`, lines 248-249): a list of variable-length tensors. The
  text cache keeps them padded with their mask; `forward` drops the padding as the pipeline does;
- the transformer takes a LIST of (C, 1, H, W) latents (lines 530-531), the timestep as `(1000 - t) / 1000`, i.e.
  1 - sigma (line 511: t = 0 is noise), and the list of caption embeddings; it predicts the NEGATIVE of the
  velocity the scheduler steps along (`noise_pred = -noise_pred`, line 568), so `forward` negates it back;
- the shift: sigmas linspace(1, 1/n) (line 137) shifted by the scheduler: its static shift (3.0 for Turbo), or
  exp(mu) of the 2x2 token count when its dynamic shifting is on (lines 471-490; the scheduler's set_timesteps);
- guidance: on when `guidance_scale > 0` (line 283), as `pos + g * (pos - neg)` (line 551): 0 is no guidance
  (Turbo's setting), and g here is the usual scale minus 1 (ai-toolkit passes `guidance_scale - 1`, z_image.py:371).
Training draws sigma logit-normally and regresses noise - x0 against the negated output, as diffusers'
examples/dreambooth/train_dreambooth_lora_z_image.py does (lines 1747-1769: `model_pred = -model_pred`,
`target = noise - model_input`, timestep `(1000 - timesteps) / 1000`) and ai-toolkit's Z-Image model
(extensions_built_in/diffusion_models/z_image/z_image.py:391-400, 456-459). LoRA goes on the attention
projections and the SwiGLU MLP of the main layers and both refiners (diffusers' script defaults to the attention
only, line 1282; ai-toolkit adapts every Linear of the transformer, z_image.py:70), never the adaLN modulation.

Turbo is step-distilled (8-9 steps, no guidance). A LoRA trained on it directly learns the subject but slowly
undoes the distillation: samples at 8 steps get blurry after a few thousand steps. ai-toolkit's answer
(z_image.py:84-165, ui options.tsx "zimage:turbo") is a "training adapter": a de-distillation LoRA
(ostris/zimage_turbo_training_adapter) merged into the frozen Turbo weights while training, so the new LoRA
learns only the subject, and removed (multiplier -1) when sampling, so the LoRA is used on plain Turbo. Here that
is `flow.training_adapter` (trainer/families/flow/training_adapter.py: the same function by forward hooks, off
for samples), which presets/zimage-turbo-lora-24gb.yaml sets to ostris's file; samples at 8 steps, guidance 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import ZImagePipeline

from trainer.families.components.transfer import on_device
from trainer.families.flow.family import FlowFamily

# diffusers' ZImageTransformer2DModel: `layers`, `noise_refiner` and `context_refiner` hold the same block.
BLOCK_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3")


class ZImageFamily(FlowFamily):
    """Z-Image: the flow-matching core (FlowFamily) with Z-Image's hooks."""

    name = "zimage"
    pipeline_class = ZImagePipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    t5_name = "text_encoder"  # kept fp32 under fp16 as T5 is: Qwen3 is a bf16 model, fp16 may overflow it

    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return {"layers": BLOCK_TARGETS, "noise_refiner": BLOCK_TARGETS, "context_refiner": BLOCK_TARGETS}

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 512

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """The pipeline's embedding (its real tokens only), padded back to `max_sequence_length` with a mask, so
        that captions stack in the text cache."""
        length = self.max_sequence_length()
        (embeds,), _ = self.flow.pipe.encode_prompt(caption, device=self.flow.text_device, do_classifier_free_guidance=False,
                                                     max_sequence_length=length)
        padded = embeds.new_zeros(1, length, embeds.shape[-1], dtype=torch.float32)
        padded[0, :embeds.shape[0]] = embeds.float()
        mask = torch.zeros(1, length, device=embeds.device)
        mask[0, :embeds.shape[0]] = 1.0
        return {"embeds": padded, "mask": mask}

    @staticmethod
    def _caption_list(text: dict, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
        """The pipeline's list of variable-length caption embeddings (lines 248-249) from padded ones."""
        embeds, mask = on_device(text["embeds"], device, dtype), on_device(text["mask"], device)
        return [e[m.bool()] for e, m in zip(embeds, mask)]

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.scheduler_shift(latent_shape)

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        latents = list(noisy.unsqueeze(2).unbind(dim=0))  # (C, 1, H, W) each: one frame per image
        timestep = (1.0 - sigmas).to(noisy.dtype)  # the pipeline's (1000 - t) / 1000 with t = 1000 sigma
        out = model(latents, timestep, self._caption_list(text, noisy.device, noisy.dtype), return_dict=False)[0]
        return -torch.stack(out, dim=0).squeeze(2)  # Z-Image predicts x0 - noise: the velocity is its negative

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt, negative_prompt or ""]  # with guidance the pipeline encodes "" without a negative prompt

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length(), "negative_prompt": negative_prompt or None}

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        device, dtype = self.ctx.device, self.flow.text_dtype
        text, negative = self.flow.cached(prompt), self.flow.cached(negative_prompt or "")
        return {"prompt_embeds": self._caption_list(text, device, dtype),
                "negative_prompt_embeds": self._caption_list(negative, device, dtype)}

    # ---- exports ------------------------------------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The diffusers module paths under `diffusion_model.`, with lora_A/lora_B and an alpha per module: ComfyUI
        runs Z-Image as its Lumina2 model, whose LoRA key map (comfy/lora.py, model_lora_keys_unet, the
        `comfy.model_base.Lumina2` branch) names each diffusers path of comfy/utils.py z_image_to_diffusers
        (`layers.N.attention.to_q` ... onto slices of its fused `attention.qkv`, `to_out.0` onto `attention.out`,
        `feed_forward.w1/w2/w3` as they are) with a `diffusion_model.` prefix. The diffusers file would map too,
        but it has no alpha: ComfyUI would apply it at alpha = rank. This is also ai-toolkit's Z-Image layout."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            path, _, rest = key.removeprefix("transformer.").partition(".lora_")
            out[f"diffusion_model.{path}.lora_{rest}"] = tensor
            out[f"diffusion_model.{path}.alpha"] = torch.tensor(float(alphas[path]))
        return out

    def comfy_adapter_name(self, path: str) -> str:
        """LoKr/LoHa/DoRA under the plain LoRA file's `diffusion_model.<diffusers path>` names: ComfyUI's Lumina2
        branch of model_lora_keys_unet maps `diffusion_model.<path>`, `transformer.<path>`, `lycoris_<path with _>`
        and `<path>` for each z_image_to_diffusers key, not OneTrainer's `lora_transformer_` names (mapped for
        its Flux model only): FlowFamily's default would be dropped there, layer by layer."""
        return f"diffusion_model.{path}"

    def kohya_metadata(self) -> dict[str, str]:
        return {"ss_base_model_version": "zimage", "ss_v2": "False", "modelspec.architecture": "zimage/lora",
                "modelspec.implementation": "https://github.com/Tongyi-MAI/Z-Image",
                "modelspec.prediction_type": "flow"}

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        from trainer.errors import UserError

        # Tongyi-MAI release Z-Image as a diffusers folder only (huggingface.co/Tongyi-MAI/Z-Image-Turbo: transformer/
        # shards and config.json, no original-layout file); the single file ComfyUI loads is Comfy-Org's
        # repackaging in its Lumina2 names (comfy/utils.py z_image_to_diffusers), not a release format. The folder
        # is the release's own layout, and save_flow_full keeps it with this reason as a warning.
        raise UserError("Z-Image's original release is a diffusers folder (Tongyi-MAI/Z-Image-Turbo), so output/"
                        "diffusers is the model in its published layout: load it with ZImagePipeline."
                        "from_pretrained; set full.save_single_file=false to skip this note")
