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

from trainer.families.components import trained_weights
from trainer.families.components.transfer import on_device
from trainer.families.flow.outputs import save_flow_outputs
from trainer.families.flow.trainer import FlowTransformerTrainer
from trainer.families.protocol import Evaluates, Sample, WorkerContext

TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
           "attn.add_v_proj", "attn.to_add_out", "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")


class SD3Family:
    """SD3/3.5, composed of the flow-matching trainer it holds (`flow`), to which it is the `FlowModel`."""

    name = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder", "text_encoder_2", "text_encoder_3")
    t5_name = "text_encoder_3"

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

    # ---- FlowModel: what the trainer asks of SD3 ----------------------------------------------------------
    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return {"transformer_blocks": TARGETS}

    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 256

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        embeds, _, pooled, _ = self.flow.pipe.encode_prompt(caption, None, None, device=self.ctx.device,
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
