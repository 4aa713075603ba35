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
from trainer.families.components.adapters import model_kind
from trainer.families.components.lycoris_files import kohya_tensors, save_peft_folders, write_file
from trainer.families.components.run_outputs import save_full, training_metadata

TE_PREFIXES = ("lora_te1", "lora_te2")


def save_sdxl_lora(out_dir, unet, text_encoders=(), *, rank: int, alpha: float, metadata: dict) -> dict[str, Path]:
    """Write the diffusers and kohya files of an SDXL LoRA; `text_encoders` is () or (te1, te2) with LoRA layers."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    unet = unwrap(unet)
    text_encoders = tuple(unwrap(te) for te in text_encoders)
    adapter_kind = model_kind(unet)
    if adapter_kind in ("lokr", "loha"):  # no diffusers LoRA file holds these: peft folders, and the kohya file
        save_peft_folders(out_dir, dict(zip(("unet", "text_encoder", "text_encoder_2"), (unet, *text_encoders))))
        path = _write_kohya(out_dir, _lycoris_tensors(unet, text_encoders), rank=rank, alpha=alpha,
                            metadata=metadata, train_text_encoder=bool(text_encoders))
        return {"peft": out_dir / "peft", "kohya": path}
    dora = adapter_kind == "dora"
    adapter, unet_modules = _lora_modules(unet)
    trained_rank = _most_common(r for r, _ in unet_modules.values())
    trained_alpha = _most_common(_configured_alpha(unet, p, adapter) for p in unet_modules)
    if trained_rank != rank or not math.isclose(trained_alpha, alpha):
        raise ValueError(f"the UNet's LoRA layers have rank {trained_rank} and alpha {trained_alpha}, not {rank}/{alpha}")
    unet_state = _peft_state(unet, adapter)
    tes = []  # (peft state, {module: (rank, alpha)}) per text encoder
    for te in text_encoders:
        te_adapter, modules = _lora_modules(te)
        tes.append((_peft_state(te, te_adapter), modules))

    te_layers = [convert_state_dict_to_diffusers({clip_module_path(k): v for k, v in s.items()}) for s, _ in tes]
    te_meta = [diffusers_adapter_metadata(m, path_fn=_strip_text_model, use_dora=dora) for _, m in tes]
    StableDiffusionXLPipeline.save_lora_weights(
        out_dir,
        unet_lora_layers=convert_state_dict_to_diffusers(unet_state),
        text_encoder_lora_layers=te_layers[0] if tes else None,
        text_encoder_2_lora_layers=te_layers[1] if tes else None,
        weight_name=DIFFUSERS_WEIGHT_NAME,
        safe_serialization=True,
        unet_lora_adapter_metadata=diffusers_adapter_metadata(unet_modules, use_dora=dora),
        text_encoder_lora_adapter_metadata=te_meta[0] if tes else None,
        text_encoder_2_lora_adapter_metadata=te_meta[1] if tes else None,
    )

    if dora:
        tensors = _lycoris_tensors(unet, text_encoders)
    else:
        alphas = {kohya_module_name(p, UNET_PREFIX): a for p, (_, a) in unet_modules.items()}
        tensors = convert_lora_state(unet_state, prefix=UNET_PREFIX, alpha=alphas)
        for prefix, (state, modules) in zip(TE_PREFIXES, tes):
            te_alphas = {kohya_module_name(clip_module_path(p), prefix): a for p, (_, a) in modules.items()}
            tensors.update(convert_lora_state(state, prefix=prefix, alpha=te_alphas, path_fn=clip_module_path))
    path = _write_kohya(out_dir, tensors, rank=rank, alpha=alpha, metadata=metadata, train_text_encoder=bool(tes))
    return {"diffusers": out_dir / DIFFUSERS_WEIGHT_NAME, "kohya": path}


def _lycoris_tensors(unet, text_encoders) -> dict:
    def te_name(prefix):
        return lambda p: kohya_module_name(clip_module_path(p), prefix)

    return kohya_tensors((unet, lambda p: kohya_module_name(p, UNET_PREFIX)),
                         *((te, te_name(prefix)) for prefix, te in zip(TE_PREFIXES, text_encoders)))


def _write_kohya(out_dir: Path, tensors: dict, *, rank: int, alpha: float, metadata: dict,
                 train_text_encoder: bool) -> Path:
    info = dict(metadata)
    name = str(info.pop("name", None) or "lora")
    kwargs = {key: info.pop(key) for key in _METADATA_ARGS if info.get(key) is not None}
    kwargs["base_model_version"] = "sdxl_base_v1-0"
    header = kohya_metadata(rank=rank, alpha=alpha, name=name, train_text_encoder=train_text_encoder, extra=info,
                            **kwargs)
    return write_file(out_dir / f"{_file_name(name)}_kohya.safetensors", tensors, header)


def save_sdxl_outputs(family, out_dir: Path, *, step: int) -> list[str]:
    cfg = family.cfg
    unwrap_model = family.ctx.unwrap
    out_dir.mkdir(parents=True, exist_ok=True)
    metadata = training_metadata(family, step)
    metadata["base_model_version"] = "sdxl_base_v1-0"
    if cfg.method == "lora" and (cfg.lora.type != "lora" or cfg.lora.dora):
        from trainer.families.components.lycoris_files import network_metadata

        metadata.update(network_metadata(cfg.lora))
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
