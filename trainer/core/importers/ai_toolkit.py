"""ai-toolkit job files (the YAML `run.py` takes and its UI writes: `config.process[0]` with `network`, `save`,
`datasets`, `train`, `model`, `sample`; names from ostris/ai-toolkit's config/examples and ui/.../jobConfig.ts)
-> an imagetune preset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.core.importers.common import (Imported, count_images, integer, is_set, number, square_resolution,
                                           steps_from_epochs)
from trainer.errors import UserError

ARCHES = {"flux": "flux", "sdxl": "sdxl", "sd15": "sd", "sd3": "sd3", "sd35": "sd3"}
FLAGS = {"is_flux": "flux", "is_xl": "sdxl", "is_v3": "sd3", "is_v2": "sd"}
OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "adam8bit": "adamw8bit", "sgd": "sgd",
              "prodigy": "prodigy", "adafactor": "adafactor", "automagic": None}
PRECISIONS = {"bf16": "bf16", "float16": "fp16", "fp16": "fp16", "float32": "fp32", "fp32": "fp32"}
# What each section's keys become; the ones not here are listed as not imported, with WHY's reason or a general one.
WHY = {
    "quantize": "imagetune stores the frozen base in fp8 or nf4 through model.base_weights (set to fp8 here)",
    "quantize_te": "imagetune keeps the frozen text encoders in the plan's precision",
    "low_vram": "imagetune places the models itself",
    "conv": "imagetune adapts linear layers; convolutions are not adapted",
    "conv_alpha": "imagetune adapts linear layers; convolutions are not adapted",
    "lokr_full_rank": "imagetune's LoKr is full where lora.rank is at least half a side (as LyCORIS)",
    "content_or_style": "imagetune samples timesteps by flow.timestep_sampling (logit_normal by default)",
    "diff_output_preservation": "not in imagetune; prior preservation is prior.* / regularization folders",
    "bypass_guidance_embedding": "imagetune feeds FLUX's guidance embedding flow.guidance",
    "mask_path": "imagetune's masks are data.masks (alpha, or a folder of masks named like the images)",
    "network_weight": "every folder trains at full weight in imagetune",
    "flip_y": "imagetune flips horizontally only",
    "push_to_hub": "imagetune does not upload to the Hub yet",
    "max_step_saves_to_keep": "imported as checkpoint.keep",
    "walk_seed": "imagetune gives prompt i seed sample.seed + i (sample.seed is imported)",
    "unload_text_encoder": "imagetune moves frozen encoders off the GPU once captions are cached",
}
# Not reported: how ai-toolkit runs or saves (imagetune decides these itself), and noise_scheduler, which is each
# model's own objective in both (flowmatch for SD3/FLUX, ddpm for SD/SDXL).
SILENT = {"noise_scheduler", "type", "training_folder", "device", "sqlite_db_path", "performance_log_every",
          "save_format", "dtype",
          "sampler", "sample_start_step", "skip_first_sample", "force_first_sample", "log_every", "use_ui_logger",
          "cache_latents_to_disk", "shrink_video_to_frames", "num_frames", "fps", "controls", "qtype", "qtype_te",
          "model_kwargs", "network_kwargs", "switch_boundary_every", "mask_min_value", "default_caption",
          "diff_output_preservation_multiplier", "diff_output_preservation_class", "name_or_path", "arch",
          "is_flux", "is_xl", "is_v3", "is_v2", "is_reg", "folder_path", "compile", "disable_sampling"}


def read_ai_toolkit(path: Path) -> Imported:
    import yaml

    try:
        job = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"--import-ai-toolkit: cannot read {path} ({exc.strerror or exc}).") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--import-ai-toolkit: {path} is not valid YAML ({str(exc).splitlines()[0]}).") from None
    process = ((job or {}).get("config") or {}).get("process") if isinstance(job, dict) else None
    if not isinstance(process, list) or not process or not isinstance(process[0], dict):
        raise UserError(f"--import-ai-toolkit: {path} is not an ai-toolkit job: it needs config.process, a list "
                        "with the trainer's settings (network, datasets, train, model, sample).")
    imported = Imported(source=str(path))
    step = process[0]
    name = job["config"].get("name")
    if is_set(name):
        imported.set("name", str(name))
    if len(process) > 1:
        imported.skip("config.process[1:]", f"{len(process) - 1} more", "imagetune imports the first process only")
    trigger = step.get("trigger_word")
    _model(step.get("model") or {}, imported, path)
    _network(step.get("network") or {}, imported)
    batch = _train(step.get("train") or {}, imported)
    images = _datasets(step.get("datasets") or [], imported, trigger)
    if imported.get("train.steps") is None:
        steps_from_epochs(imported, 1, images, batch)
    _save(step.get("save") or {}, imported)
    _sample(step.get("sample") or {}, imported, trigger)
    for key, value in step.items():
        if key not in ("model", "network", "train", "datasets", "save", "sample", "trigger_word", "logging") \
                and key not in SILENT and is_set(value):
            imported.skip(key, value, WHY.get(key, "no imagetune equivalent"))
    return imported


def _rest(section: str, values: dict, used: set[str], imported: Imported) -> None:
    for key, value in values.items():
        if key not in used and key not in SILENT and is_set(value):
            imported.skip(f"{section}.{key}", value, WHY.get(key, "no imagetune equivalent"))


def _model(model: dict, imported: Imported, path: Path) -> None:
    arch = str(model.get("arch") or "").split(":")[0]
    family = ARCHES.get(arch) or next((f for flag, f in FLAGS.items() if model.get(flag)), None)
    if family is None:
        named = arch or "(no arch, no is_flux / is_xl / is_v3 flag)"
        raise UserError(f"--import-ai-toolkit: {path} trains {named}, which is not a model imagetune trains "
                        "(SD 1.x/2.x, SDXL, SD3 and FLUX.1).")
    imported.set("model.family", family)
    if is_set(model.get("name_or_path")):
        imported.set("model.path", str(model["name_or_path"]))
    if model.get("quantize") and family in ("flux", "sd3", "sdxl"):
        imported.set("model.base_weights", "fp8")
        imported.set("train.gradient_checkpointing", True)
        imported.notes.append("model.base_weights fp8: ai-toolkit's `quantize` (8-bit base weights)")
    elif "quantize" in model:  # `quantize: false`: the base as loaded, unquantized
        imported.set("model.base_weights", "bf16")
    _rest("model", model, {"quantize"}, imported)


def _network(network: dict, imported: Imported) -> None:
    kind = str(network.get("type") or "lora").lower()
    if kind in ("lokr", "loha"):
        imported.set("lora.type", kind)
    elif kind != "lora":
        imported.skip("network.type", kind, "imagetune trains LoRA, LoKr and LoHa; LoRA is used")
    if number(network.get("linear")):
        imported.set("lora.rank", integer(network["linear"]))
    if number(network.get("linear_alpha")):
        imported.set("lora.alpha", number(network["linear_alpha"]))
    factor = integer(network.get("lokr_factor"))
    if kind == "lokr" and factor is not None:
        imported.set("lora.factor", factor)
    _rest("network", network, {"type", "linear", "linear_alpha", "lokr_factor"}, imported)


def _train(train: dict, imported: Imported) -> int:
    used = {"batch_size", "steps", "gradient_accumulation", "gradient_accumulation_steps", "lr", "optimizer",
            "optimizer_params", "gradient_checkpointing", "train_text_encoder", "train_unet", "ema_config", "dtype",
            "loss_type", "cache_text_embeddings", "noise_offset", "min_snr_gamma", "timestep_type"}
    batch = integer(train.get("batch_size")) or 1
    accumulation = integer(train.get("gradient_accumulation") or train.get("gradient_accumulation_steps")) or 1
    imported.set("batch.total", batch * accumulation)
    if batch > 1:
        imported.set("batch.per_device", batch)
    if integer(train.get("steps")):
        imported.set("train.steps", integer(train["steps"]))
    if number(train.get("lr")):
        imported.set("train.lr", number(train["lr"]))
    optimizer = str(train.get("optimizer") or "adamw").lower()
    if OPTIMIZERS.get(optimizer):
        imported.set("train.optimizer", OPTIMIZERS[optimizer])
    else:
        imported.skip("train.optimizer", optimizer, "not an imagetune optimizer; adamw is used")
    for key, value in (train.get("optimizer_params") or {}).items():
        if key == "weight_decay" and number(value) is not None:
            imported.set("train.weight_decay", number(value))
        else:
            imported.skip(f"train.optimizer_params.{key}", value, "imagetune sets weight_decay, betas and eps only")
    if train.get("gradient_checkpointing"):
        imported.set("train.gradient_checkpointing", True)
    if train.get("train_text_encoder"):
        imported.set("lora.train_text_encoder", True)
    ema = train.get("ema_config") or {}
    if ema.get("use_ema"):
        imported.set("lora.ema", True)
        if number(ema.get("ema_decay")):
            imported.set("lora.ema_decay", number(ema["ema_decay"]))
    if str(train.get("dtype")) in PRECISIONS:
        imported.set("precision", PRECISIONS[str(train["dtype"])])
    loss = str(train.get("loss_type") or "mse")
    if loss in ("l1", "huber"):
        imported.set("train.loss", loss)
    elif loss != "mse":
        imported.skip("train.loss_type", loss, "imagetune's losses are mse, huber and l1")
    if train.get("cache_text_embeddings"):
        imported.set("data.cache_text_embeddings", True)
    if number(train.get("noise_offset")):
        imported.set("train.noise_offset", number(train["noise_offset"]))
    if number(train.get("min_snr_gamma")) and imported.get("model.family") in ("sd", "sdxl"):
        imported.set("train.min_snr_gamma", number(train["min_snr_gamma"]))
    timesteps = train.get("timestep_type")
    if timesteps not in (None, "sigmoid", "linear"):
        imported.skip("train.timestep_type", timesteps, "imagetune samples logit_normal (sigmoid) or uniform")
    elif timesteps == "linear":
        imported.set("flow.timestep_sampling", "uniform")
    _rest("train", train, used, imported)
    return batch * accumulation


def _datasets(datasets: list, imported: Imported, trigger: Any) -> int | None:
    entries: list[dict] = []
    images: int | None = 0
    for n, dataset in enumerate(d for d in datasets if isinstance(d, dict)):
        if not is_set(dataset.get("folder_path")):
            imported.skip(f"datasets[{n}]", dataset, "a dataset without folder_path")
            continue
        entry: dict = {"path": str(dataset["folder_path"])}
        if integer(dataset.get("num_repeats")) not in (None, 1):
            entry["repeats"] = integer(dataset["num_repeats"])
        if is_set(dataset.get("caption_ext")):
            entry["caption_extension"] = "." + str(dataset["caption_ext"]).lstrip(".")
        if number(dataset.get("caption_dropout_rate")):
            entry["caption_dropout"] = number(dataset["caption_dropout_rate"])
        if dataset.get("shuffle_tokens"):
            entry["shuffle_tags"] = True
        if dataset.get("flip_x"):
            entry["flip"] = True
        if dataset.get("is_reg"):
            entry["is_regularization"] = True
        if is_set(dataset.get("default_caption")):
            entry["instance_prompt"] = str(dataset["default_caption"])
        if dataset.get("resolution") is not None and n == 0:
            side = square_resolution(dataset["resolution"], imported, f"datasets[{n}].resolution")
            if side:
                imported.set("data.resolution", side)
        used = {"folder_path", "num_repeats", "caption_ext", "caption_dropout_rate", "shuffle_tokens", "flip_x",
                "resolution"}
        _rest(f"datasets[{n}]", dataset, used, imported)
        entries.append(entry)
        found = count_images(Path(entry["path"]))
        images = images + found * entry.get("repeats", 1) if found is not None and images is not None else None
    if is_set(trigger):
        imported.set("data.caption_prefix", f"{trigger},")
        imported.notes.append(f"data.caption_prefix '{trigger},': ai-toolkit's trigger_word (it adds the word only to "
                              "captions that lack it; imagetune puts it before every caption)")
    if len(entries) == 1 and set(entries[0]) == {"path"}:
        imported.set("data.path", entries[0]["path"])
    elif entries:
        imported.set("data.datasets", entries)
    if not entries:
        imported.notes.append("no dataset folder was named: set data.path")
    return images if entries else None


def _save(save: dict, imported: Imported) -> None:
    if integer(save.get("save_every")):
        imported.set("checkpoint.every", integer(save["save_every"]))
    if integer(save.get("max_step_saves_to_keep")):
        imported.set("checkpoint.keep", integer(save["max_step_saves_to_keep"]))
    _rest("save", save, {"save_every", "max_step_saves_to_keep"}, imported)


def _sample(sample: dict, imported: Imported, trigger: Any) -> None:
    prompts = [s.get("prompt") if isinstance(s, dict) else s for s in sample.get("samples") or sample.get("prompts")
               or []]
    prompts = [str(p).replace("[trigger]", str(trigger or "")).strip() for p in prompts if is_set(p)]
    if prompts:
        imported.set("sample.prompts", prompts)
    for theirs, ours in (("sample_every", "sample.every"), ("seed", "sample.seed"), ("sample_steps", "sample.steps"),
                         ("guidance_scale", "sample.guidance_scale"), ("width", "sample.width"),
                         ("height", "sample.height"), ("neg", "sample.negative_prompt")):
        value = sample.get(theirs)
        if is_set(value):
            imported.set(ours, value if theirs == "neg" else (number(value) if theirs == "guidance_scale"
                                                               else integer(value)))
    _rest("sample", sample, {"samples", "prompts", "sample_every", "seed", "sample_steps", "guidance_scale", "width",
                             "height", "neg"}, imported)
