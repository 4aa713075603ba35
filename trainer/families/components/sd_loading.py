"""Load Stable Diffusion 1.x/2.x components from a diffusers folder, a single-file checkpoint or a hub id."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.core.config.schema import ModelConfig
from trainer.errors import UserError

if TYPE_CHECKING:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, PreTrainedTokenizerBase

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".bin")


@dataclass
class SDComponents:
    unet: UNet2DConditionModel
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: PreTrainedTokenizerBase  # CLIPTokenizer, or its fast version where the model folder has one
    scheduler_config: dict
    prediction_type: str


def load_pipeline(model: ModelConfig, pipeline_cls, *, folder_hint: str = "unet/, vae/, text_encoder/, tokenizer/",
                  **kwargs):
    """`pipeline_cls` (a diffusers pipeline class) from a local folder, a single file or a hub id, in fp32 on the
    CPU; loading errors become a UserError that says what to check."""
    path = model.path
    local = Path(path).expanduser()
    try:
        if local.is_file() and local.suffix in SINGLE_FILE_SUFFIXES:
            single: dict[str, object] = {"config": model.config} if model.config else {}
            if model.config and Path(model.config).exists():
                single["local_files_only"] = True
            single.update({k: v for k, v in kwargs.items() if k == "safety_checker"})
            return pipeline_cls.from_single_file(str(local), dtype=torch.float32, **single)
        return pipeline_cls.from_pretrained(
            str(local) if local.exists() else path,
            dtype=torch.float32,
            revision=model.revision,
            variant=model.variant,
            **kwargs,
        )
    except (OSError, ValueError, EnvironmentError) as exc:
        hint = (
            "For a single-file checkpoint offline, set model.config to a diffusers folder of the same model "
            "version."
            if local.is_file()
            else f"Check that the folder holds model_index.json with {folder_hint} and "
            "scheduler/, or that the hub id is right and this machine has network."
        )
        raise UserError(f"Could not load the model at model.path '{path}': {_first_line(exc)}. {hint}") from None


def load_sd_components(model: ModelConfig) -> SDComponents:
    """Every component in fp32 on the CPU; the caller moves and casts them."""
    from diffusers import StableDiffusionPipeline

    pipe = load_pipeline(model, StableDiffusionPipeline, safety_checker=None, requires_safety_checker=False)

    prediction_type = model.prediction_type
    if prediction_type == "auto":
        prediction_type = pipe.scheduler.config.get("prediction_type", "epsilon")
    return SDComponents(
        unet=pipe.unet,
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        scheduler_config=dict(pipe.scheduler.config),
        prediction_type=prediction_type,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
