"""The final files of a flow-matching family's run (rank 0, into `<run>/output/`).

A full fine-tune (the EMA weights, if `full.ema`):

- `diffusers/`: the whole pipeline as a diffusers folder (`FluxPipeline.from_pretrained` /
  `StableDiffusion3Pipeline.from_pretrained`); the transformer alone is `diffusers/transformer/`;
- with `full.save_single_file` (the default), `<name>.safetensors` in bf16 through the family's
  `save_single_file` hook, named as SD's and SDXL's:
  - FLUX: the transformer alone in Black Forest Labs' layout (as `flux1-dev.safetensors`: ComfyUI's
    "Load Diffusion Model", with the base model's VAE and text encoders; `trainer.families.flow.flux_checkpoint`);
  - SD3/3.5: Stability's single-file layout, MMDiT + VAE + CLIP-L + CLIP-G + T5 (ComfyUI's "Load Checkpoint",
    `StableDiffusion3Pipeline.from_single_file`; `trainer.families.flow.sd3_checkpoint`);
  - FLUX.1 Kontext: FLUX.1's file; Chroma: lodestones' layout (`trainer.families.chroma.checkpoint`); FLUX.2 [dev]
    and [klein]: BFL's FLUX.2 layout (`trainer.families.flux2.checkpoint`), each ComfyUI's "Load Diffusion Model";
  - Z-Image, Qwen-Image: none, their releases being diffusers folders; the hook raises a UserError that says so,
    which save_flow_full logs as a warning and keeps the folder.
  All come from the weights in memory (under FSDP `ctx.unwrap` gives rank 0's gathered copy, as for the folder)
  and are written to a `.partial` file and renamed.

A LoRA:

- `pytorch_lora_weights.safetensors`: the transformer's peft state dict written by the pipeline's own
  `save_lora_weights` (as diffusers' DreamBooth LoRA scripts do), with `lora_adapter_metadata` (rank, alpha,
  exact target paths) so `pipe.load_lora_weights(output/)` rebuilds the same scaling;
- `<name>_kohya.safetensors` in the family's kohya/ComfyUI layout (its `kohya_lora` hook: FLUX's fused BFL names in
  `trainer.families.flow.kohya_flux`; none for SD3, whose diffusers file ComfyUI reads as is) with `ss_*` /
  modelspec metadata (base model, trigger word, rank, alpha, steps; the family's `kohya_metadata`).
- LoKr / LoHa / DoRA: peft folders, and names over diffusers paths that ComfyUI maps (the family's
  `comfy_adapter_name`: OneTrainer's `lora_transformer_...` for SD3, FLUX and Chroma).
"""

from __future__ import annotations

from pathlib import Path


def save_flow_outputs(trainer, out_dir: Path, *, step: int) -> list[str]:
    """The outputs of a run (see above). `trainer`: the family's FlowTransformerTrainer, or anything with its
    `cfg`, `ctx`, `name`, `pipe`, `transformer`, `pipeline_class` and `model` (the family's export hooks). An EMA run's averaged weights are in the
    transformer already (the worker swaps them in: trainer.engine.ema)."""
    if trainer.cfg.method == "full":
        return save_flow_full(trainer, out_dir, step=step)
    return save_flow_lora(trainer, out_dir, step=step)


def flow_metadata(trainer, step: int) -> dict:
    from trainer.families.components.run_outputs import run_metadata

    flow = trainer.cfg.flow
    return {**run_metadata(trainer, step), "family": trainer.name, "timestep_sampling": flow.timestep_sampling,
            "lora_blocks": flow.lora_blocks}


def save_flow_lora(trainer, out_dir: Path, *, step: int) -> list[str]:
    from trainer.families.components.adapters import model_kind
    from trainer.families.components.lora_files import (
        DIFFUSERS_WEIGHT_NAME,
        _file_name,
        _lora_modules,
        _peft_state,
        diffusers_adapter_metadata,
    )
    from trainer.families.components.lycoris_files import kohya_tensors, network_metadata, save_peft_folders

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    transformer = trainer.ctx.unwrap(trainer.transformer)
    kind = model_kind(transformer)
    if kind in ("lokr", "loha"):  # no diffusers LoRA file holds these: a peft folder
        outputs = [str(p) for p in save_peft_folders(out_dir, {"transformer": transformer})]
    else:
        adapter, modules = _lora_modules(transformer)
        state = _peft_state(transformer, adapter)
        metadata = diffusers_adapter_metadata(modules, use_dora=kind == "dora")
        trainer.pipeline_class.save_lora_weights(out_dir, transformer_lora_layers=state,
                                                 weight_name=DIFFUSERS_WEIGHT_NAME, safe_serialization=True,
                                                 transformer_lora_adapter_metadata=metadata)
        outputs = [str(out_dir / DIFFUSERS_WEIGHT_NAME)]
    if kind == "lora":  # the family's ComfyUI layout, or None where ComfyUI reads the diffusers file itself
        tensors = trainer.model.kohya_lora(state, {p: a for p, (_, a) in modules.items()}, transformer)
        if tensors is None:
            return outputs
    else:  # names over diffusers paths that ComfyUI maps onto (slices of) its weights: the comfy_adapter_name hook
        tensors = kohya_tensors((transformer, trainer.model.comfy_adapter_name))
    extra = network_metadata(trainer.cfg.lora) if kind != "lora" else {}
    name = _file_name(trainer.cfg.name or "lora")
    outputs.append(str(_write_flow_kohya(trainer, out_dir / f"{name}_kohya.safetensors", tensors, step, extra)))
    return outputs


def _write_flow_kohya(trainer, path: Path, tensors: dict, step: int, extra: dict) -> Path:
    from trainer.families.components.kohya import kohya_metadata
    from trainer.families.components.lycoris_files import write_file

    cfg = trainer.cfg
    info = flow_metadata(trainer, step)
    name = str(info.pop("name") or "lora")
    for key in ("steps", "base_model", "resolution"):
        info.pop(key)
    overrides = trainer.model.kohya_metadata()
    header = kohya_metadata(rank=cfg.lora.rank, alpha=cfg.lora.alpha, name=name, base_model_version=overrides[
                            "ss_base_model_version"], steps=step, base_model=cfg.model.path,
                            resolution=cfg.data.resolution, extra={**info, **overrides, **extra})
    return write_file(path, tensors, header)


def save_flow_full(trainer, out_dir: Path, *, step: int | None = None) -> list[str]:
    cfg = trainer.cfg
    out_dir = Path(out_dir)
    pipe = trainer.pipe
    transformer = trainer.ctx.unwrap(trainer.transformer)  # under FSDP: the gathered full weights (rank 0)
    folder = out_dir / "diffusers"
    pipe.transformer = transformer
    try:
        pipe.save_pretrained(folder, safe_serialization=True)
    finally:
        pipe.transformer = trainer.transformer
    outputs = [str(folder)]
    if cfg.full.save_single_file:
        from trainer.errors import UserError

        try:
            path = save_flow_single_file(trainer, transformer, out_dir / f"{cfg.name}.safetensors", step=step)
        except UserError as err:  # the end of a long run: keep the folder, say why there is no single file
            trainer.ctx.log_warning(f"output: no single file ({err}); the diffusers folder has the whole model")
        else:
            outputs.append(str(path))
    return outputs


def save_flow_single_file(trainer, transformer, path: Path, *, step: int | None = None) -> Path:
    """The original-layout file of a full fine-tune, from the models in memory (`transformer`: the unwrapped one)."""
    from trainer.families.components.run_outputs import run_metadata

    flow = trainer.cfg.flow
    metadata = {**run_metadata(trainer, step), "family": trainer.name, "method": "full",
                "timestep_sampling": flow.timestep_sampling}
    if step is None:  # not known to the caller: leave it out rather than write "None"
        metadata.pop("steps")
    return trainer.model.save_single_file(transformer, path, metadata)
