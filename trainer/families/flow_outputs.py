"""The final files of an SD3 or FLUX run (rank 0, into `<run>/output/`). A full fine-tune: the whole pipeline
as a diffusers folder, `output/diffusers/` (`FluxPipeline.from_pretrained` / `StableDiffusion3Pipeline...`);
the transformer alone is `output/diffusers/transformer/`. A LoRA:

- `pytorch_lora_weights.safetensors`: the transformer's peft state dict written by the pipeline's own
  `save_lora_weights` (as diffusers' DreamBooth LoRA scripts do), with `lora_adapter_metadata` (rank, alpha,
  exact target paths) so `pipe.load_lora_weights(output/)` rebuilds the same scaling;
- FLUX also `<name>_kohya.safetensors` in the kohya/ComfyUI layout (`trainer.export.kohya_flux`) with `ss_*` /
  modelspec metadata (base model, trigger word, rank, alpha, steps).
"""

from __future__ import annotations

import os
from pathlib import Path



def flow_metadata(family, step: int) -> dict:
    from trainer.families.sd_outputs import run_metadata

    flow = family.cfg.flow
    return {**run_metadata(family, step), "family": family.name, "timestep_sampling": flow.timestep_sampling,
            "lora_blocks": flow.lora_blocks}


def save_flow_lora(family, out_dir: Path, *, step: int) -> list[str]:
    from safetensors.torch import save_file

    from trainer.export.kohya import kohya_metadata
    from trainer.export.lora_files import (DIFFUSERS_WEIGHT_NAME, _file_name, _lora_modules, _peft_state,
                                           diffusers_adapter_metadata)

    cfg = family.cfg
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    transformer = family.ctx.unwrap(family.transformer)
    adapter, modules = _lora_modules(transformer)
    state = _peft_state(transformer, adapter)
    family.pipeline_class.save_lora_weights(out_dir, transformer_lora_layers=state, weight_name=DIFFUSERS_WEIGHT_NAME,
                                            safe_serialization=True,
                                            transformer_lora_adapter_metadata=diffusers_adapter_metadata(modules))
    outputs = [str(out_dir / DIFFUSERS_WEIGHT_NAME)]
    if family.name == "flux":
        from trainer.export.kohya_flux import flux_metadata_overrides, flux_to_kohya

        out_features = {n: m.out_features for n, m in transformer.named_modules()
                        if isinstance(getattr(m, "out_features", None), int)}
        tensors = flux_to_kohya(state, {p: a for p, (_, a) in modules.items()}, out_features)
        info = flow_metadata(family, step)
        name = str(info.pop("name") or "lora")
        for key in ("steps", "base_model", "resolution"):
            info.pop(key)
        extra = {**info, **flux_metadata_overrides(guidance_embeds=family.guidance_embeds)}
        header = kohya_metadata(rank=cfg.lora.rank, alpha=cfg.lora.alpha, name=name, base_model_version="flux1",
                                steps=step, base_model=cfg.model.path, resolution=cfg.data.resolution, extra=extra)
        path = out_dir / f"{_file_name(name)}_kohya.safetensors"
        partial = path.with_name(path.name + ".partial")
        save_file(tensors, str(partial), metadata=header)
        os.replace(partial, path)
        outputs.append(str(path))
    return outputs


def save_flow_full(family, out_dir: Path) -> list[str]:
    pipe = family.pipe
    folder = Path(out_dir) / "diffusers"
    pipe.transformer = family.ctx.unwrap(family.transformer)  # under FSDP: the gathered full weights
    try:
        pipe.save_pretrained(folder, safe_serialization=True)
    finally:
        pipe.transformer = family.transformer
    return [str(folder)]
