"""The final artifacts of an SD run: a LoRA (diffusers + kohya files) or a full model (diffusers folder +
single file). Written by rank 0 into `<run>/output/`."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def training_metadata(family, step: int) -> dict:
    cfg = family.cfg
    return {
        "name": cfg.name,
        "base_model": cfg.model.path,
        "base_model_version": "sd_v2" if family.text_encoder.config.hidden_size == 1024 else "sd_v1",
        "prediction_type": family.prediction_type,
        "steps": step,
        "batch_total": cfg.batch.total,
        "lr": cfg.train.lr,
        "resolution": cfg.data.resolution,
        "seed": cfg.seed,
        "trigger": cfg.data.instance_prompt or "",
        "train_text_encoder": family.train_text_encoder,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def save_sd_outputs(family, out_dir: Path, *, step: int) -> list[str]:
    cfg = family.cfg
    unwrap = family.ctx.unwrap
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = training_metadata(family, step)
    if cfg.method == "lora":
        from trainer.export.lora_files import save_lora

        text_encoder = unwrap(family.text_encoder) if family.train_text_encoder else None
        files = save_lora(out_dir, unwrap(family.unet), text_encoder, rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                          metadata=metadata)
        return [str(p) for p in files.values()]

    pipe = family.pipeline()
    ema = getattr(family, "ema", None)
    if ema is not None:  # the averaged weights are the output; the live ones were only the path there
        ema.copy_to(unwrap(family.unet).parameters())
    folder = out_dir / "diffusers"
    pipe.save_pretrained(folder, safe_serialization=True)
    outputs = [str(folder)]
    if cfg.full.save_single_file:
        from trainer.export.ldm_checkpoint import save_single_file

        single = out_dir / f"{cfg.name}.safetensors"
        save_single_file(folder, single, dtype=torch.float16)
        outputs.append(str(single))
    return outputs
