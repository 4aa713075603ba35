"""kohya's dataset options -> data.*: the arguments (train_data_dir, reg_data_dir, buckets, caption options), a
dataset TOML's [general], [[datasets]] and [[datasets.subsets]] (sd-scripts' library/config_util.py names), and
the batch and run length they imply."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from trainer.core.importers.common import (Imported, count_images, integer, is_set, number, square_resolution,
                                           steps_from_epochs)
from trainer.core.importers.kohya_keys import DATASET_KEYS, WHY


def read_data(take: Callable, imported: Imported, args: dict, dataset: dict | None) -> None:
    """The images, their captions and augmentation, the batch and the run's length in steps."""
    resolution = take("resolution") if "resolution" in args else take("max_resolution")
    if is_set(resolution):
        side = square_resolution(resolution, imported, "resolution")
        if side:
            imported.set("data.resolution", side)
    batch = integer(take("train_batch_size")) or 1
    for key in DATASET_KEYS:  # the same names in the args and in a dataset TOML's [general]
        _data_key(key, take(key), imported)
    if take("cache_text_encoder_outputs") or take("sdxl_cache_text_encoder_outputs") or \
            take("flux1_cache_text_encoder_outputs") or take("sd3_cache_text_encoder_outputs"):
        imported.set("data.cache_text_embeddings", True)
    workers = integer(take("max_data_loader_n_workers"))
    if workers is not None and "max_data_loader_n_workers" in args:
        imported.set("data.workers", workers)
    images: int | None = None
    folder = take("train_data_dir")
    if is_set(folder):
        imported.set("data.path", str(folder))
        images = count_images(Path(str(folder)))
    reg = take("reg_data_dir")
    if is_set(reg):
        imported.set("data.datasets", [{"path": str(folder)}, {"path": str(reg), "is_regularization": True}])
        imported.preset["data"].pop("path", None)
    weight = number(take("prior_loss_weight"))
    if is_set(reg) and weight is not None and weight != 1:
        imported.set("prior.loss_weight", weight)
    if dataset is not None:
        images, batch = _datasets(dataset, imported, batch)
    accumulation = integer(take("gradient_accumulation_steps")) or 1
    processes = integer(take("num_processes")) or 1
    imported.set("batch.total", batch * accumulation * processes)
    if batch > 1:
        imported.set("batch.per_device", batch)
    epochs = integer(take("max_train_epochs")) or integer(take("epoch"))
    if imported.get("train.steps") is None and epochs:
        steps_from_epochs(imported, epochs, images, batch * accumulation * processes)
    if imported.get("data.path") is None and imported.get("data.datasets") is None:
        imported.notes.append("no training images were named (train_data_dir or dataset_config): set data.path")


def _data_key(key: str, value: Any, imported: Imported, prefix: str = "data.") -> None:
    """One kohya dataset option (args, [general], [[datasets]] or a subset) -> the data.* / entry key."""
    if value is None:
        return
    if key == "enable_bucket" and prefix == "data.":
        imported.set("data.bucketing", bool(value))
    elif key in ("bucket_reso_steps", "min_bucket_reso", "max_bucket_reso") and prefix == "data.":
        ours = {"bucket_reso_steps": "bucket_step", "min_bucket_reso": "bucket_min_side",
                "max_bucket_reso": "bucket_max_side"}[key]
        step = integer(value)
        if key == "bucket_reso_steps" and step and step % 8:
            imported.skip(key, value, "bucket sides must be multiples of 8 here; 64 is used")
        elif step:
            imported.set(prefix + ours, step)
    elif key == "caption_extension" and is_set(value):
        if str(value).startswith(".none"):
            imported.skip(key, value, "images without a caption file take data.instance_prompt or their kohya "
                                      "folder's name; the default .txt is kept")
        else:
            imported.set(prefix + key, str(value))
    elif key in ("flip_aug", "shuffle_caption", "caption_prefix", "keep_tokens", "caption_dropout_rate") \
            and is_set(value):
        renamed = {"flip_aug": "flip", "shuffle_caption": "shuffle_tags", "caption_dropout_rate": "caption_dropout"}
        typed = integer(value) if key == "keep_tokens" else number(value) if key == "caption_dropout_rate" else value
        imported.set(prefix + renamed.get(key, key), typed)
    elif key == "random_crop" and value and prefix == "data.":
        imported.set("data.center_crop", False)
    elif key == "alpha_mask" and value and prefix == "data.":
        imported.set("data.masks", "alpha")
    elif key == "cache_latents" and prefix == "data." and value is False:
        imported.set("data.cache_latents", False)
    elif is_set(value) and key not in ("enable_bucket", "bucket_reso_steps", "min_bucket_reso", "max_bucket_reso",
                                       "random_crop", "alpha_mask", "cache_latents"):
        imported.skip(key, value, WHY.get(key, "no imagetune equivalent"))


def _datasets(config: dict, imported: Imported, batch: int) -> tuple[int | None, int]:
    """A dataset TOML: [general] defaults, [[datasets]] (resolution, batch, buckets) of [[datasets.subsets]]."""
    for key, value in (config.get("general") or {}).items():
        _data_key(key, value, imported)
    groups = config.get("datasets") or []
    entries: list[dict] = []
    images, counted = 0, True
    for group in groups:
        resolution = None
        for key, value in group.items():
            if key == "resolution":
                resolution = square_resolution(value, imported, "datasets.resolution")
                if resolution and group is groups[0]:
                    imported.set("data.resolution", resolution)
            elif key == "batch_size":
                batch = integer(value) or batch
            elif key != "subsets":
                _data_key(key, value, imported)
        for subset in group.get("subsets") or []:
            entry: dict = {}
            sub = Imported(source=imported.source)
            for key, value in subset.items():
                if key == "image_dir":
                    entry["path"] = str(value)
                elif key == "num_repeats":
                    entry["repeats"] = integer(value) or 1
                elif key == "class_tokens":
                    entry["instance_prompt"] = str(value)
                elif key == "is_reg":
                    entry["is_regularization"] = bool(value)
                else:
                    _data_key(key, value, sub, prefix="")
            entry.update(sub.preset)
            if resolution and group is not groups[0]:
                entry["resolution"] = resolution
            imported.unmapped += [(f"subsets[{len(entries)}].{k}", why) for k, why in sub.unmapped]
            if "path" not in entry:
                imported.skip("subsets", subset, "a subset without image_dir (metadata_file fine-tuning sets are not "
                                                 "read; use a folder of images with .txt captions)")
                continue
            entries.append(entry)
            found = count_images(Path(entry["path"]))
            if found is None:
                counted = False
            elif not entry.get("is_regularization"):
                images += found * entry.get("repeats", 1)
    if len(entries) == 1 and set(entries[0]) == {"path"}:
        imported.set("data.path", entries[0]["path"])
    elif entries:
        imported.set("data.datasets", entries)
    return (images if counted and entries else None), batch
