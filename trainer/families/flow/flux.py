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
from trainer.families.components import trained_weights
from trainer.families.components.transfer import on_device
from trainer.families.flow.outputs import save_flow_outputs
from trainer.families.flow.trainer import FlowTransformerTrainer
from trainer.families.protocol import Evaluates, Sample, WorkerContext

DOUBLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                  "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                  "ff_context.net.2")
SINGLE_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out")


class FluxFamily:
    """FLUX.1, composed of the flow-matching trainer it holds (`flow`), to which it is the `FlowModel`."""

    name = "flux"
    pipeline_class = FluxPipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder", "text_encoder_2")
    t5_name = "text_encoder_2"

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.flow = FlowTransformerTrainer(ctx, self)
        self.prepared: list[torch.nn.Module] = []
        self.ema: Any = None
        self.item_buckets: list[int] | None = None
        self.evaluator: Evaluates | None = None  # the validation loss, when the run holds images out

    # ---- Family: the flow-matching trainer does the work --------------------------------------------------
    def load(self) -> None:
        self.flow.load()
        self.evaluator = self.flow.evaluator

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.flow.transformer]

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        self.prepared = modules

    def param_groups(self) -> list[dict]:
        return self.flow.param_groups()

    def prepare_data(self) -> int:
        count = self.flow.prepare_data()
        self.item_buckets = self.flow.data.item_buckets
        return count

    def loss(self, samples: list[Sample]) -> torch.Tensor:
        return self.flow.loss(samples, self.prepared[0])

    def fetch(self, samples: list[Sample]) -> list[dict[str, torch.Tensor]]:
        return self.flow.data.fetch(samples)  # in a DataLoader worker with data.workers > 0 (trainer.engine.input)

    def loss_of(self, samples: list[Sample], fetched: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        with self.flow.data.fetched(samples, fetched):
            return self.loss(samples)

    def render_samples(self, step: int):
        shape = trained_weights.sample_shape(self.cfg.sample, self.cfg.data.resolution, self.flow.data.buckets,
                                             self.flow.data.item_buckets)
        return trained_weights.render_prompt_samples(self.cfg.sample, self.sample, shape)

    def sample(self, prompts: list[str], seeds: list[int], **options):
        return self.flow.sample(prompts, seeds, **options)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.flow.trainable_state()

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        self.flow.load_trainable_state(state)

    def save_outputs(self, out_dir: Path, *, step: int) -> list[str]:
        return save_flow_outputs(self.flow, out_dir, step=step)

    # ---- FlowModel: what the trainer asks of FLUX ---------------------------------------------------------
    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        blocks = self.cfg.flow.lora_blocks
        out: dict[str, tuple[str, ...]] = {}
        if blocks in ("all", "double"):
            out["transformer_blocks"] = DOUBLE_TARGETS
        if blocks in ("all", "single"):
            out["single_transformer_blocks"] = SINGLE_TARGETS
        return out

    @property
    def guidance_embeds(self) -> bool:
        return bool(self.flow.transformer.config.guidance_embeds)

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or (512 if self.guidance_embeds else 256)

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.flow.pipe.encode_prompt(caption, prompt_2=None, device=self.ctx.device,
                                                         max_sequence_length=self.max_sequence_length())
        return {"embeds": embeds.float(), "pooled": pooled.float()}

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        s = self.flow.scheduler_config
        if self.cfg.flow.shift or not s.get("use_dynamic_shifting"):
            return self.flow.static_shift()
        seq_len = (latent_shape[-2] // 2) * (latent_shape[-1] // 2)
        return fm.resolution_shift(seq_len, base_seq_len=s.get("base_image_seq_len", 256),
                                   max_seq_len=s.get("max_image_seq_len", 4096), base_shift=s.get("base_shift", 0.5),
                                   max_shift=s.get("max_shift", 1.15))

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
