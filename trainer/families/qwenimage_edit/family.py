"""Qwen-Image-Edit (Qwen/Qwen-Image-Edit-2509, -2511): Qwen-Image's transformer taught to edit the control image
as the instruction says, trained on pairs (data.control_path). What people train today is the "Plus" release
(2509, 2511), which diffusers runs as QwenImageEditPlusPipeline; the first Qwen/Qwen-Image-Edit runs as
QwenImageEditPipeline with another prompt template and its control always at 1024², and is refused at load.

Everything is as QwenImageEditPlusPipeline (pipelines/qwenimage/pipeline_qwenimage_edit_plus.py, diffusers 0.42)
draws:
- text: the instruction goes through Qwen2.5-VL *with the control image*: the image resized to about 384² pixels
  (`calculate_dimensions(CONDITION_IMAGE_SIZE, ratio)`, lines 66, 158-165, 699-705), "Picture 1: " and the vision
  tokens before the instruction in the edit template (lines 239-252), the processor's pixel values and grid (lines
  254-266), the last hidden state at the real tokens without the first 64 (`prompt_template_encode_start_idx`,
  lines 216, 251, 268-271). `encode_caption` calls the pipeline's own `encode_prompt` with that image, so the
  embedding of a pair is the pipeline's; it depends on (caption, control image) and is cached per pair, keyed by
  the control file's path and content digest (`text_key`): a changed control image is a new key, so a new cache.
  The pipeline does not truncate (its max_sequence_length is only checked, line 392): a longer embedding than
  the cache's `flow.max_sequence_length` (default 512) is refused, not cut;
- the control's latents: its VAE distribution's mode (`sample_mode="argmax"`, lines 425-430: here the cached mean),
  normalised per channel as the target (line 441), packed into 2x2 tokens (line 487) and appended after the noisy
  target's (`torch.cat([latents, image_latents], dim=1)`, line 811); `img_shapes` lists the target's (1, h/2, w/2)
  then the control's (lines 753-761), which places the control's RoPE positions and, with the transformer's
  `zero_cond_t` (2511), modulates its tokens with timestep 0 (transformer_qwenimage.py lines 920-926); the
  prediction is read at the target's tokens (`noise_pred[:, : latents.size(1)]`, line 826), so the loss is;
- the timestep as sigma (`timestep / 1000`, line 818), no guidance embedding, the shift exp(mu) of the target's
  token count alone (`image_seq_len = latents.shape[1]`, line 765, before the control is appended);
- true CFG with a negative prompt, encoded with the same control image (lines 708, 729-738, 843-845).
Training as Qwen-Image's (trainer.families.qwenimage.family, after diffusers' train_dreambooth_lora_qwen_image.py):
velocity noise - x0 at the noisy input's sigma, no loss weighting, logit-normal timesteps with the pipeline's shift
by default (`flow.timestep_sampling: uniform`, `flow.shift: 1` give that script's uniform draw).
The control is cached at its target's bucket, crop (never flipped: the checks refuse data.flip, since the text
encoder reads the unflipped image), as ai-toolkit's and musubi-tuner's edit trainers and FLUX.1 Kontext's here;
at 1024 px that is the pipeline's own 1024² control. Samples edit the control of the first training image, the
pipeline's VAE_IMAGE_SIZE (line 67) set to the sample's area for the call, so the control is encoded at the size
the run trains at. LoRA targets, latents and exports are Qwen-Image's (components/qwen_image.py): ComfyUI runs the
edit models as its QwenImage model, with the same key layout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
from PIL import Image

from trainer.errors import UserError
from trainer.families.components import flow_matching as fm
from trainer.families.components import qwen_image, trained_weights
from trainer.families.components.qwen_image import BLOCK_TARGETS, ImageVAE
from trainer.families.components.transfer import on_device
from trainer.families.flow.family import FlowFamily


@functools.lru_cache(maxsize=None)
def _digest(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def file_digest(path: str) -> str:
    """The content digest of a control image (read once per file version)."""
    stat = os.stat(path)
    return _digest(path, stat.st_mtime_ns, stat.st_size)


def condition_image(path: str) -> Image.Image:
    """The control image as the pipeline hands it to Qwen2.5-VL: resized to about 384² pixels, its aspect ratio
    kept in multiples of 32 (lines 699-705)."""
    with Image.open(path) as opened:
        image = opened.convert("RGB")
    width, height = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, image.width / image.height)
    return image.resize((width, height), Image.Resampling.LANCZOS)  # VaeImageProcessor.resize's PIL filter


@contextlib.contextmanager
def vae_image_area(pixels: int):
    """The pipeline encodes its control image at about VAE_IMAGE_SIZE pixels (1024², line 702): set for a sample
    drawn at the size the run trains its pairs at."""
    before = plus.VAE_IMAGE_SIZE
    plus.VAE_IMAGE_SIZE = pixels
    try:
        yield
    finally:
        plus.VAE_IMAGE_SIZE = before


class QwenImageEditFamily(FlowFamily):
    """Qwen-Image-Edit: the flow-matching core (FlowFamily) with Qwen-Image's transformer parts and the control
    image in both the text encoder's input and the transformer's image sequence."""

    name = "qwenimage_edit"
    pipeline_class = QwenImageEditPlusPipeline
    text_encoder_names: tuple[str, ...] = ("text_encoder",)
    t5_name = "text_encoder"  # Qwen2.5-VL is a bf16 model: fp32 under fp16, as T5, rather than overflow

    def load(self) -> None:
        self._refuse_the_first_release()
        super().load()

    def _refuse_the_first_release(self) -> None:
        path = self.cfg.model.path
        local = Path(path).expanduser()
        try:
            index = self.pipeline_class.load_config(str(local) if local.exists() else path,
                                                    revision=self.cfg.model.revision)
        except (OSError, ValueError):
            return  # the load reports it, with its own message
        if index.get("_class_name") == "QwenImageEditPipeline":
            raise UserError(f"model.path '{path}' is the first Qwen-Image-Edit (QwenImageEditPipeline), whose prompt "
                            "template and control size differ from the 2509/2511 releases this family trains "
                            "(QwenImageEditPlusPipeline): use Qwen/Qwen-Image-Edit-2511 or -2509")

    # ---- Qwen-Image's transformer and VAE (components/qwen_image.py) ----------------------------------------
    def default_lora_targets(self) -> dict[str, tuple[str, ...]]:
        return {"transformer_blocks": BLOCK_TARGETS}  # one kind of block: flow.lora_blocks is refused (checks)

    def lora_paths(self, paths: list[str]) -> list[str]:
        return qwen_image.reaching_prediction(paths, self.flow.transformer.config.num_layers)

    def image_vae(self, vae: Any) -> Any:
        return ImageVAE(vae)

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return qwen_image.normalize_latents(self.flow.vae.config, latents)

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        return self.flow.scheduler_shift(latent_shape)  # of the target's shape: the control adds no tokens to mu

    # ---- text: (caption, control image) pairs --------------------------------------------------------------
    def max_sequence_length(self) -> int:
        return self.cfg.flow.max_sequence_length or 512

    def text_key(self, caption: str, control: str | None) -> str:
        assert control is not None, "the config checks require data.control_path"
        return json.dumps([caption, control, file_digest(control)])

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        text, control, _ = json.loads(caption)
        length = self.max_sequence_length()
        embeds, _ = self.flow.pipe.encode_prompt(text, image=[condition_image(control)], device=self.ctx.device)
        n = embeds.shape[1]
        if n > length:
            raise UserError(f"flow.max_sequence_length: the caption {text!r} with its control image {control} is "
                            f"{n} tokens (its vision tokens included), more than {length}; the pipeline reads it "
                            "whole, so raise flow.max_sequence_length (at most 1024) or shorten the caption")
        # Padded to one length so that pairs stack in the cache; forward trims the padding back off.
        padded = torch.cat([embeds.float(), embeds.new_zeros(1, length - n, embeds.shape[2]).float()], dim=1)
        mask = torch.cat([torch.ones(1, n), torch.zeros(1, length - n)], dim=1).to(embeds.device)
        return {"embeds": padded, "mask": mask}

    def forward(self, model: Any, noisy: torch.Tensor, sigmas: torch.Tensor, text: dict) -> torch.Tensor:
        b, _, h, w = noisy.shape
        device, dtype = noisy.device, noisy.dtype
        control = on_device(text["control"], device, dtype)
        ch, cw = control.shape[-2:]
        mask = on_device(text["mask"], device)
        n = int(mask.sum(dim=1).max().item())  # the batch's longest embedding, as a padded batch would be
        embeds, mask = on_device(text["embeds"], device, dtype)[:, :n], mask[:, :n]
        packed = model(hidden_states=torch.cat([fm.pack_latents(noisy), fm.pack_latents(control)], dim=1),
                       timestep=sigmas.to(dtype), encoder_hidden_states=embeds,
                       encoder_hidden_states_mask=None if bool(mask.all()) else mask.bool(),
                       img_shapes=[[(1, h // 2, w // 2), (1, ch // 2, cw // 2)]] * b, return_dict=False)[0]
        return fm.unpack_latents(packed[:, :(h // 2) * (w // 2)], h, w)

    # ---- samples: the first training pair's control image ---------------------------------------------------
    def _sample_control(self) -> str:
        assert self.flow.data.control_paths is not None, "the config checks require data.control_path"
        return self.flow.data.control_paths["instance"][0]

    def texts_for(self, prompt: str, negative_prompt: str) -> list[str]:
        control = self._sample_control()  # " ": the pipeline guides only with a negative prompt (line 708)
        return [self.text_key(prompt, control), self.text_key(negative_prompt or " ", control)]

    def guidance_kwargs(self, guidance_scale: float) -> dict:
        return {"true_cfg_scale": guidance_scale}  # guidance_scale feeds a guidance embedding it lacks

    def sample_kwargs(self, negative_prompt: str) -> dict:
        return {"negative_prompt": negative_prompt or " "}

    def embedded_prompt_kwargs(self, prompt: str, negative_prompt: str) -> dict:
        def trimmed(key: str) -> tuple[torch.Tensor, torch.Tensor]:
            text = self.flow.cached(key)
            n = int(text["mask"].sum().item())
            return text["embeds"][:, :n], text["mask"][:, :n].long()

        positive, negative = self.texts_for(prompt, negative_prompt)
        embeds, mask = trimmed(positive)
        negative_embeds, negative_mask = trimmed(negative)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "negative_prompt_embeds": negative_embeds,
                "negative_prompt_embeds_mask": negative_mask}

    def sample_image_kwargs(self, width: int, height: int) -> dict:
        """The control image as it is on disk: the pipeline makes its 384² condition image from it, as the
        cached embeddings were made, and its VAE image at the sample's area (`sample`)."""
        with Image.open(self._sample_control()) as opened:
            return {"image": opened.convert("RGB")}

    def sample(self, prompts: list[str], seeds: list[int], **options):
        """One pipeline call per image: QwenImageEditPlusPipeline draws one prompt at a time (lines 681-686)."""
        width, height = trained_weights.pixel_size(options.get("size"), self.cfg.data.resolution)
        with vae_image_area(width * height):
            return [image for prompt, seed in zip(prompts, seeds)
                    for image in self.flow.sample([prompt], [seed], **options)]

    # ---- exports: Qwen-Image's (the same transformer, the same ComfyUI model) -------------------------------
    def kohya_lora(self, state: dict[str, torch.Tensor], alphas: dict[str, float],
                   transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        return qwen_image.kohya_lora(state, alphas)

    def comfy_adapter_name(self, path: str) -> str:
        return qwen_image.comfy_name(path)

    def kohya_metadata(self) -> dict[str, str]:
        return qwen_image.kohya_metadata("qwen-image-edit/lora", "https://huggingface.co/Qwen/Qwen-Image-Edit-2511")

    def save_single_file(self, transformer: torch.nn.Module, path: Path, metadata: dict) -> Path:
        # Qwen release the edit models as diffusers folders only (Qwen/Qwen-Image-Edit-2511: transformer/ shards
        # and config.json), as Qwen-Image; save_flow_full keeps the folder with this reason as a warning.
        raise UserError("Qwen-Image-Edit's original release is a diffusers folder (Qwen/Qwen-Image-Edit-2511), so "
                        "output/diffusers is the model in its published layout: load it with "
                        "QwenImageEditPlusPipeline.from_pretrained; set full.save_single_file=false to skip this note")
