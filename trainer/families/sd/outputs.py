"""The final artifacts of an SD run: a LoRA (diffusers + kohya files) or a full model (diffusers folder +
single file). Written by rank 0 into `<run>/output/`."""

from __future__ import annotations

from pathlib import Path

from trainer.families.components.run_outputs import save_full, training_metadata


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
