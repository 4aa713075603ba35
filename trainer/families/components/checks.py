"""Config checks the diffusion families share (torch-free): the base model and the image folder exist, the
held-out images, caption augmentation, loss masks and the loss's keys."""

from __future__ import annotations

import os
from pathlib import Path

from trainer.core.config.schema import TrainConfig
from trainer.core.config.validate import DEMO_SCHEME, is_hub_id
from trainer.core.data.masks import ALPHA
from trainer.families.components.dataset_checks import dataset_problems


def model_path_problem(key: str, path: str) -> str | None:
    if not path:
        return f"{key}: is empty; set it to a diffusers folder, a .safetensors file or a hub id"
    if path.startswith(DEMO_SCHEME) or Path(path).expanduser().exists():
        return None
    if is_hub_id(path):
        if os.environ.get("HF_HUB_OFFLINE") == "1":
            return f"{key}: '{path}' looks like a hub id, but HF_HUB_OFFLINE=1; download it first or use a local path"
        return None
    return f"{key}: '{path}' does not exist; give a local folder/file that exists or a hub id like org/name"


def diffusion_checks(config, *, check_paths: bool = True) -> list[str]:
    """model.path / model.config name a model; data.path a folder of captioned images; the held-out images;
    caption augmentation, masks and the loss."""
    p = held_out_problems(config, check_paths=check_paths) + augmentation_problems(config, check_paths=check_paths)
    p += dataset_problems(config, check_paths=check_paths)
    trains_text_encoder = config.lora.train_text_encoder if config.method == "lora" else config.full.train_text_encoder
    if config.train.text_encoder_lr is not None and not trains_text_encoder:
        section = "lora" if config.method == "lora" else "full"
        p.append(f"train.text_encoder_lr: {config.train.text_encoder_lr:g} is the text encoder's learning rate, but "
                 f"this run does not train it ({section}.train_text_encoder is false): set "
                 f"{section}.train_text_encoder=true, or unset train.text_encoder_lr")
    if not check_paths:
        return p
    p += [q for key, value in (("model.path", config.model.path), ("model.config", config.model.config))
          if (key == "model.path" or value) and (q := model_path_problem(key, value))]
    return p


def held_out_problems(config, *, check_paths: bool = True) -> list[str]:
    """data.val_split / data.val_path / eval.best (the validation loss); whether data.path holds enough images
    for the split is the data check's to say (trainer.core.data.holdout)."""
    data, p = config.data, []
    if not 0 <= data.val_split < 1:
        p.append(f"data.val_split: must be a fraction in [0, 1) of data.path's images to hold out for the validation "
                 f"loss (0.1: one image in ten; 0: none), got {data.val_split}")
    if data.val_split and data.val_path:
        p.append("data.val_path: data.val_split is set too, but the held-out images come from one of them: a share "
                 "of data.path (data.val_split) or a folder of their own (data.val_path); leave data.val_path empty "
                 "or set data.val_split=0")
    if config.eval.best == "val_loss" and not (data.val_split or data.val_path):
        p.append("eval.best: val_loss needs held-out images to measure it on: set data.val_split (e.g. 0.1) or "
                 "data.val_path, or set eval.best=auto")
    if check_paths and data.val_path and not data.val_path.startswith(DEMO_SCHEME):
        folder = Path(data.val_path).expanduser()
        if not folder.is_dir():
            p.append(f"data.val_path: folder '{data.val_path}' does not exist; point it at a folder of captioned "
                     "images kept out of training, or leave it empty")
        elif data.path and not data.path.startswith(DEMO_SCHEME) and _same_folder(folder, Path(data.path)):
            p.append("data.val_path: is data.path itself, so every validation image would also be trained on; hold "
                     "out part of data.path with data.val_split instead, or give a folder of other images")
    return p


def _same_folder(a: Path, b: Path) -> bool:
    return os.path.realpath(a.expanduser()) == os.path.realpath(b.expanduser())


def augmentation_problems(config, *, check_paths: bool = True) -> list[str]:
    """data.caption_dropout / shuffle_tags / keep_tokens / masks, train.huber_delta / input_perturbation and
    model.zero_terminal_snr: ranges, and keys that would do nothing with the others as they are."""
    d, t, p = config.data, config.train, []
    if not 0 <= d.caption_dropout < 1:
        p.append(f"data.caption_dropout: must be a probability in [0, 1) of training a sample with the empty caption "
                 f"(0.1: one sample in ten), got {d.caption_dropout}")
    if d.keep_tokens < 0:
        p.append(f"data.keep_tokens: must be zero or more (leading tags kept in place), got {d.keep_tokens}")
    elif d.keep_tokens and not d.shuffle_tags:
        p.append(f"data.keep_tokens: {d.keep_tokens} keeps tags in place while data.shuffle_tags shuffles the "
                 "others, but shuffle_tags is off, so it would do nothing: set data.shuffle_tags=true or "
                 "data.keep_tokens=0")
    if d.shuffle_tags and d.cache_text_embeddings is True:
        p.append("data.cache_text_embeddings: true cannot hold the captions of data.shuffle_tags, which are new at "
                 "almost every step: leave it unset (they are then encoded at every step, the text encoders staying "
                 "on the GPU) or set data.shuffle_tags=false")
    if check_paths and d.masks and d.masks != ALPHA and not Path(d.masks).expanduser().is_dir():
        p.append(f"data.masks: folder '{d.masks}' does not exist; give a folder of masks named like the images, "
                 "`alpha` to use the images' transparency, or leave it empty for no masks")
    if not t.huber_delta > 0:
        p.append(f"train.huber_delta: must be greater than zero, got {t.huber_delta}")
    elif t.loss != "huber" and t.huber_delta != TrainConfig.huber_delta:
        p.append(f"train.huber_delta: {t.huber_delta} is only read by train.loss=huber, and train.loss is {t.loss}: "
                 f"set train.loss=huber, or leave train.huber_delta at its default {TrainConfig.huber_delta}")
    if t.input_perturbation < 0:
        p.append(f"train.input_perturbation: must be zero or more (0.1 is usual), got {t.input_perturbation}")
    if config.model.zero_terminal_snr and config.model.prediction_type == "epsilon":
        p.append("model.zero_terminal_snr: needs v-prediction, and model.prediction_type is epsilon: at zero terminal "
                 "SNR the last timestep's input is pure noise, which an epsilon model only copies. Set "
                 "model.prediction_type=v_prediction (to train the model into v-prediction) or auto with a "
                 "v-prediction model, or set model.zero_terminal_snr=false")
    return p
