"""The final artifacts of an SDXL run, written by rank 0 into `<run>/output/`:

- LoRA: `pytorch_lora_weights.safetensors` (diffusers/peft keys, `StableDiffusionXLPipeline.load_lora_weights`
  reads it, per-model `lora_adapter_metadata` carrying rank and alpha) and `<name>_kohya.safetensors` (kohya
  keys `lora_unet_` / `lora_te1_` / `lora_te2_` over diffusers module paths, the names ComfyUI's and diffusers'
  kohya loaders map, with `ss_*` / `modelspec.*` metadata);
- full fine-tune: a diffusers folder `diffusers/` and, when `full.save_single_file` (the default), one
  original-layout (SGM) `<name>.safetensors` in fp16 that A1111 / ComfyUI / Forge load
  (trainer.families.sdxl.checkpoint).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from trainer.families.components.kohya import UNET_PREFIX, clip_module_path, convert_lora_state, kohya_metadata, kohya_module_name
from trainer.families.components.lora_files import (
    _METADATA_ARGS,
    DIFFUSERS_WEIGHT_NAME,
    _file_name,
    _configured_alpha,
    _lora_modules,
    _most_common,
    _peft_state,
    _strip_text_model,
    diffusers_adapter_metadata,
    unwrap,
)
from trainer.families.sd.outputs import save_full, training_metadata

TE_PREFIXES = ("lora_te1", "lora_te2")


def save_sdxl_lora(out_dir, unet, text_encoders=(), *, rank: int, alpha: float, metadata: dict) -> dict[str, Path]:
    """Write the diffusers and kohya files of an SDXL LoRA; `text_encoders` is () or (te1, te2) with LoRA layers."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    unet = unwrap(unet)
    adapter, unet_modules = _lora_modules(unet)
    trained_rank = _most_common(r for r, _ in unet_modules.values())
    trained_alpha = _most_common(_configured_alpha(unet, p, adapter) for p in unet_modules)
    if trained_rank != rank or not math.isclose(trained_alpha, alpha):
        raise ValueError(f"the UNet's LoRA layers have rank {trained_rank} and alpha {trained_alpha}, not {rank}/{alpha}")
    unet_state = _peft_state(unet, adapter)
    tes = []  # (peft state, {module: (rank, alpha)}) per text encoder
    for te in text_encoders:
        te = unwrap(te)
        te_adapter, modules = _lora_modules(te)
        tes.append((_peft_state(te, te_adapter), modules))

    te_layers = [convert_state_dict_to_diffusers({clip_module_path(k): v for k, v in s.items()}) for s, _ in tes]
    te_meta = [diffusers_adapter_metadata(m, path_fn=_strip_text_model) for _, m in tes]
    StableDiffusionXLPipeline.save_lora_weights(
        out_dir,
        unet_lora_layers=convert_state_dict_to_diffusers(unet_state),
        text_encoder_lora_layers=te_layers[0] if tes else None,
        text_encoder_2_lora_layers=te_layers[1] if tes else None,
        weight_name=DIFFUSERS_WEIGHT_NAME,
        safe_serialization=True,
        unet_lora_adapter_metadata=diffusers_adapter_metadata(unet_modules),
        text_encoder_lora_adapter_metadata=te_meta[0] if tes else None,
        text_encoder_2_lora_adapter_metadata=te_meta[1] if tes else None,
    )

    alphas = {kohya_module_name(p, UNET_PREFIX): a for p, (_, a) in unet_modules.items()}
    tensors = convert_lora_state(unet_state, prefix=UNET_PREFIX, alpha=alphas)
    for prefix, (state, modules) in zip(TE_PREFIXES, tes):
        te_alphas = {kohya_module_name(clip_module_path(p), prefix): a for p, (_, a) in modules.items()}
        tensors.update(convert_lora_state(state, prefix=prefix, alpha=te_alphas, path_fn=clip_module_path))

    info = dict(metadata)
    name = str(info.pop("name", None) or "lora")
    kwargs = {key: info.pop(key) for key in _METADATA_ARGS if info.get(key) is not None}
    kwargs["base_model_version"] = "sdxl_base_v1-0"
    header = kohya_metadata(rank=rank, alpha=alpha, name=name, train_text_encoder=bool(tes), extra=info, **kwargs)
    kohya_path = out_dir / f"{_file_name(name)}_kohya.safetensors"
    partial = kohya_path.with_name(kohya_path.name + ".partial")
    save_file(tensors, str(partial), metadata=header)
    os.replace(partial, kohya_path)
    return {"diffusers": out_dir / DIFFUSERS_WEIGHT_NAME, "kohya": kohya_path}


def save_sdxl_outputs(family, out_dir: Path, *, step: int) -> list[str]:
    cfg = family.cfg
    unwrap_model = family.ctx.unwrap
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = training_metadata(family, step)
    metadata["base_model_version"] = "sdxl_base_v1-0"
    if cfg.method == "lora":
        tes = (unwrap_model(family.text_encoder), unwrap_model(family.text_encoder_2)) if family.train_text_encoder else ()
        files = save_sdxl_lora(out_dir, unwrap_model(family.unet), tes, rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                               metadata=metadata)
        return [str(p) for p in files.values()]

    if family.text_embeddings is not None:  # the pipeline saves the text encoders too
        from trainer.families.components.text_cache import onload

        onload(family.ctx.device, family.text_encoder, family.text_encoder_2)
    from trainer.families.sdxl.checkpoint import save_sdxl_single_file

    return save_full(family, out_dir, save_sdxl_single_file)
