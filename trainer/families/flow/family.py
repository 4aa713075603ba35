"""The shared core of the flow-matching transformer families (SD3, FLUX.1 and their successors).

`FlowFamily` is the engine's Family (trainer.families.protocol) for any flow-matching transformer: it holds a
`FlowTransformerTrainer` (loading, LoRA, latent and text caches, the loss, sampling) and passes the protocol's
calls to it. A family subclasses it once and declares only what differs between models, as the hooks of
`FlowModel` (trainer.families.flow.trainer): the pipeline class, the text encoders and how a caption becomes
conditioning, the transformer's call (latent packing, guidance input, timestep scale), the timestep shift, the LoRA
targets, and its exported files (`kohya_lora`, `kohya_metadata`, `save_single_file`). Nothing here or in the
trainer branches on a family's name: a hook a family does not declare is an AttributeError at its first use, not a
sibling's behaviour.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from trainer.families.components import trained_weights
from trainer.families.flow.outputs import save_flow_outputs
from trainer.families.flow.trainer import FlowModel, FlowTransformerTrainer
from trainer.families.protocol import Evaluates, Sample, WorkerContext


class FlowFamily:
    """A flow-matching family: the Family protocol over the trainer it holds (`flow`), to which it is the
    `FlowModel` (its subclass declares the hooks)."""

    name: str
    pipeline_class: Any
    text_encoder_names: tuple[str, ...]

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.cfg = ctx.config
        self.flow = FlowTransformerTrainer(ctx, cast(FlowModel, self))  # the subclass declares the hooks
        self.prepared: list[torch.nn.Module] = []
        self.ema: Any = None
        self.item_buckets: list[int] | None = None
        self.evaluator: Evaluates | None = None  # the validation loss, when the run holds images out

    # ---- FlowModel hooks with a default, what FLUX.1, SD3 and Chroma need --------------------------------------
    # Qwen-Image's VAE is a video VAE (a frame dimension, per-channel mean/std), its guidance argument is
    # true_cfg_scale, its last block's text stream is never read, and ComfyUI maps no OneTrainer names for it: it
    # overrides these five. FLUX.2 overrides normalize_latents (batch-norm statistics of 2x2-patchified latents).
    def lora_paths(self, paths: list[str]) -> list[str]:
        return paths  # every selected layer reaches the prediction (FLUX's last double block feeds its single ones)

    def image_vae(self, vae: Any) -> Any:
        return vae  # a 2D AutoencoderKL: the latent cache calls it as it is

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.flow.vae.config
        return (latents - (vae.shift_factor or 0.0)) * vae.scaling_factor

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale}

    def checkpointing_func(self, transformer: Any) -> Any:
        return None  # diffusers' own: torch.utils.checkpoint of each block, non-reentrant

    def text_key(self, caption: str, control: str | None) -> str:
        return caption  # the text encoders read the caption alone (Kontext's T5 and CLIP never see its control)

    def sample_image_kwargs(self, width: int, height: int) -> dict:
        return {}  # text-to-image: the prompt is all a sample needs (the edit families add their control image)

    def comfy_adapter_name(self, path: str) -> str:
        # OneTrainer's names, which ComfyUI maps for SD3 and Flux (Chroma) through their diffusers-to-original tables
        return "lora_transformer_" + path.replace(".", "_")

    def load(self) -> None:
        self.flow.load()
        self.evaluator = self.flow.evaluator

    def trainable_modules(self) -> list[torch.nn.Module]:
        return [self.flow.transformer]

    def set_prepared(self, modules: list[torch.nn.Module]) -> None:
        self.prepared = modules

    def reduce_gradients(self) -> None:
        if self.flow.block_swap is not None:  # a full fine-tune's swapped blocks (components/block_swap.py)
            self.flow.block_swap.reduce_gradients()

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
