"""The final artifacts of an SD run: a LoRA (diffusers + kohya files) or a full model (diffusers folder +
single file). Written by rank 0 into `<run>/output/`."""

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


def save_sd_outputs(family, out_dir: Path, *, step: int) -> list[str]:
    cfg = family.cfg
    unwrap = family.ctx.unwrap
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = training_metadata(family, step)
    if cfg.method == "lora" and (cfg.lora.type != "lora" or cfg.lora.dora):
        from trainer.families.components.lycoris_files import network_metadata

        metadata.update(network_metadata(cfg.lora))
    if cfg.method == "lora":
        from trainer.families.components.lora_files import save_lora

        text_encoder = unwrap(family.text_encoder) if family.train_text_encoder else None
        files = save_lora(out_dir, unwrap(family.unet), text_encoder, rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                          metadata=metadata)
        return [str(p) for p in files.values()]

    from trainer.families.components.ldm_checkpoint import save_single_file

    return save_full(family, out_dir, save_single_file)
