"""FLUX.2 (black-forest-labs): FLUX.2 [dev], a 32B guidance-distilled transformer with Mistral Small 3.x as its text
encoder, and FLUX.2 [klein] 4B/9B with a Qwen3 text encoder and no guidance embedding. Both share one transformer
class (Flux2Transformer2DModel) and the FLUX.2 VAE; only the text encoder, the pipeline class and the guidance
differ, so one set of hooks (`Flux2Hooks`) serves both registered families, `Flux2Family` (dev) and
`Flux2KleinFamily` (klein), which declare only their pipeline and what it encodes for a sample.

Everything is as diffusers' pipelines draw an image (diffusers 0.42, pipelines/flux2/):
- text, dev: Mistral's chat template with FLUX.2's system message (pipeline_flux2.py:88-95, system_messages.py),
  padded to `max_sequence_length` (512, line 331), hidden states 10, 20 and 30 stacked along the width
  (lines 312, 347-351: 3 x 5120 = 15360, the transformer's joint_attention_dim). Klein: Qwen's chat template, one
  user message with the assistant prompt and thinking off (pipeline_flux2_klein.py:226-232), padded to 512
  (line 238), hidden states 9, 18 and 27 stacked (lines 215, 257-261). No mask reaches the transformer: padding
  tokens are attended as the pipelines do. Text ids are (0, 0, 0, l) per token (pipeline_flux2.py:356-372);
- latents: the VAE's 32 channels, 2x2-patchified into 128 (`_patchify_latents`, lines 457-463), then normalised by
  the VAE's batch-norm running statistics, (z - mean) / sqrt(var + eps) (lines 613-617; undone before decoding,
  lines 1019-1024): no scaling/shift factor. The trainer keeps the VAE's layout (`normalize_latents` patchifies,
  normalises and unpatchifies: a permutation, so noise and loss are unchanged); `forward` patchifies and packs to
  (B, h*w, 128) tokens with ids (0, h, w, 0) (lines 375-405, 473-481);
- the transformer call (lines 974-984): `timestep / 1000`, i.e. sigma; `guidance`, dev's distilled guidance as a
  (B,) tensor (lines 951-952), here `flow.guidance`; klein passes None (pipeline_flux2_klein.py:854) and its
  transformer has no guidance embedding (guidance_embeds False: the hook reads the loaded transformer's config);
- the sampling shift: sigmas linspace(1, 1/n) with an empirical mu of the token count AND the step count
  (`compute_empirical_mu`, pipeline_flux2.py:159-174, 935-946), not FLUX.1's resolution shift;
- guidance when sampling: dev, the embedded value only (no negative prompt); klein, real CFG with "" as the
  negative prompt when guidance_scale > 1 and the model is not step-distilled (`is_distilled`, klein lines
  595-596, 749-758, 864-878).
Training follows diffusers' examples/dreambooth/train_dreambooth_lora_flux2.py and ..._flux2_klein.py: sigma from
the scheduler's unshifted timesteps by the weighting scheme's density (klein 1836-1850), the same patchify + batch
norm of the latents (1826-1829), `timestep / 1000`, guidance from `--guidance_scale` only where the transformer
has a guidance embedding (1856-1861), target noise - x0 (1882). LoRA: diffusers' script adapts the double blocks'
image attention and the single blocks' fused projections (1294-1305); here also the text attention and both MLPs
of the double blocks (`flow.lora_blocks` picks double/single, as for FLUX.1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline

from trainer.families.components.transfer import on_device
from trainer.families.flow.family import FlowFamily

DOUBLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                  "ff_context.linear_out")
SINGLE_TARGETS = ("attn.to_qkv_mlp_proj", "attn.to_out")  # FLUX.2's single blocks fuse qkv and the MLP's input


class Flux2Hooks(FlowFamily):
    """The flow-matching core (FlowFamily) with the hooks FLUX.2 [dev] and [klein] share (not registered itself:
    each family is a sibling subclass, neither inherits the other)."""

    name: str
    pipeline_class: Any
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    t5_name = "text_encoder"  # kept fp32 under fp16 as T5 is: Mistral and Qwen3 are bf16 models

    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        blocks = self.cfg.flow.lora_blocks
        out: dict[str, tuple[str, ...]] = {}
        if blocks in ("all", "double"):
            out["transformer_blocks"] = DOUBLE_TARGETS
        if blocks in ("all", "single"):
            out["single_transformer_blocks"] = SINGLE_TARGETS
        return out

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 512

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, _ = self.flow.pipe.encode_prompt(caption, device=self.flow.text_device,
                                                 max_sequence_length=self.max_sequence_length())
        return {"embeds": embeds.float()}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        # diffusers' scripts draw sigma from the scheduler's timesteps, unshifted under its dynamic shifting (the
        # pipelines' mu depends on the step count, which training has none of); `flow.shift` sets one.
        if self.cfg.flow.shift or not self.flow.scheduler_config.get("use_dynamic_shifting"):
            return self.flow.static_shift()
        return 1.0

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        bn, eps = self.flow.vae.bn, self.flow.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(latents.device, latents.dtype)
        patched = Flux2Pipeline._patchify_latents(latents)
        return Flux2Pipeline._unpatchify_latents((patched - mean) / std)

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.flow.transformer.config.guidance_embeds)  # the unwrapped model: DDP has no config

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        device, dtype = noisy.device, noisy.dtype
        patched = Flux2Pipeline._patchify_latents(noisy)
        b, c, h, w = patched.shape
        embeds = on_device(text["embeds"], device, dtype)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((b,), float(self.cfg.flow.guidance), device=device, dtype=torch.float32)
        out = model(hidden_states=Flux2Pipeline._pack_latents(patched), timestep=sigmas.to(dtype), guidance=guidance,
                    encoder_hidden_states=embeds, txt_ids=Flux2Pipeline._prepare_text_ids(embeds).to(device),
                    img_ids=Flux2Pipeline._prepare_latent_ids(patched).to(device), return_dict=False)[0]
        return Flux2Pipeline._unpatchify_latents(out.reshape(b, h, w, c).permute(0, 3, 1, 2))

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"max_sequence_length": self.max_sequence_length()}

    # ---- exports ------------------------------------------------------------------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The diffusers keys with an alpha per module. ComfyUI runs FLUX.2 as its Flux model (comfy/model_base.py
        `class Flux2(Flux)`), whose LoRA key map (comfy/lora.py, model_lora_keys_unet, the `model_base.Flux`
        branch) names `transformer.<diffusers path>` for every path of comfy/utils.py flux_to_diffusers, which
        maps FLUX.2's (`attn.to_qkv_mlp_proj` onto `single_blocks.N.linear1`, `attn.to_out` onto `linear2`,
        `ff.linear_in/out` onto `img_mlp.0/2`, q/k/v onto slices of the fused qkv). It reads `<key>.alpha`
        (comfy/lora.py load_lora); the diffusers file has none, so it would load at alpha = rank."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            path, _, rest = key.removeprefix("transformer.").partition(".lora_")
            out[f"transformer.{path}.lora_{rest}"] = tensor
            out[f"transformer.{path}.alpha"] = torch.tensor(float(alphas[path]))
        return out

    def kohya_metadata(self) -> dict[str, str]:
        return {"ss_base_model_version": self.name, "ss_v2": "False", "modelspec.architecture": f"{self.name}/lora",
                "modelspec.implementation": "https://github.com/black-forest-labs/flux2",
                "modelspec.prediction_type": "flow"}

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        """The transformer alone in BFL's layout (as flux2-dev.safetensors and klein's files; trainer.families
        .flux2.checkpoint): ComfyUI's "Load Diffusion Model", or Flux2Transformer2DModel.from_single_file."""
        from trainer.families.flux2.checkpoint import save_flux2_single_file

        return save_flux2_single_file(transformer, path, architecture=self.name, metadata=metadata)


class Flux2Family(Flux2Hooks):
    """FLUX.2 [dev]: the Mistral pipeline, whose guidance is the distilled input."""

    name = "flux2"
    pipeline_class = Flux2Pipeline

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt]  # dev's guidance is distilled: no negative prompt

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        return {"prompt_embeds": self.flow.cached(prompt)["embeds"]}


class Flux2KleinFamily(Flux2Hooks):
    """FLUX.2 [klein]: the Qwen3 pipeline, which samples with real guidance."""

    name = "flux2_klein"
    pipeline_class = Flux2KleinPipeline

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        return [prompt, ""]  # with guidance the pipeline encodes "" (it takes no negative prompt text)

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        return {"prompt_embeds": self.flow.cached(prompt)["embeds"],
                "negative_prompt_embeds": self.flow.cached("")["embeds"]}
