"""What every diffusion family's final files share: the run's metadata (safetensors headers) and a full
fine-tune's outputs (a diffusers folder and, with `full.save_single_file`, the original-layout single file)."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def run_metadata(family, step: int | None) -> dict:
    """What every diffusion family's output files record about the run (safetensors metadata)."""
    cfg = family.cfg
    return {
        "name": cfg.name,
        "base_model": cfg.model.path,
        "steps": step,
        "batch_total": cfg.batch.total,
        "lr": cfg.train.lr,
        "resolution": cfg.data.resolution,
        "seed": cfg.seed,
        "trigger": cfg.data.instance_prompt or "",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def training_metadata(family, step: int) -> dict:
    return {
        **run_metadata(family, step),
        "base_model_version": "sd_v2" if family.text_encoder.config.hidden_size == 1024 else "sd_v1",
        "prediction_type": family.prediction_type,
        "train_text_encoder": family.train_text_encoder,
    }


def save_full(family, out_dir: Path, write_single_file) -> list[str]:
    """A full fine-tune's outputs: the pipeline as a diffusers folder (the EMA weights, if kept: the worker swaps
    them in, trainer.engine.ema) and, with
    `full.save_single_file`, `write_single_file(folder, path, dtype=fp16)`'s original-layout checkpoint."""
    cfg = family.cfg
    folder = out_dir / "diffusers"
    family.pipeline().save_pretrained(folder, safe_serialization=True)
    outputs = [str(folder)]
    if cfg.full.save_single_file:
        single = out_dir / f"{cfg.name}.safetensors"
        write_single_file(folder, single, dtype=torch.float16)
        outputs.append(str(single))
    return outputs
