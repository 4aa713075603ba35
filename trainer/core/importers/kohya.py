"""kohya_ss GUI configs (JSON, as its Save button writes them) and sd-scripts configs (the TOML `--config_file`
takes, sections flattened as sd-scripts does, with the dataset TOML its `dataset_config` names) -> an imagetune
preset. Key names are sd-scripts' argparse names (library/train_util.py, train_network.py, flux_train_network.py)
and the GUI's (kohya_gui/*.py; the GUI names a few differently: `optimizer`, `LoRA_type`, `lr_warmup` in percent).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from trainer.core.importers.common import Imported, integer, is_set, number
from trainer.core.importers.kohya_data import read_data
from trainer.core.importers.kohya_keys import IGNORED, WHY
from trainer.core.data.confine import OUTSIDE, escapes
from trainer.errors import UserError

OPTIMIZERS = {"adamw": "adamw", "adamw8bit": "adamw8bit", "pagedadamw8bit": "adamw8bit", "sgdnesterov": "sgd",
              "sgd": "sgd", "prodigy": "prodigy", "adafactor": "adafactor", "adamwschedulefree": "adamw_schedulefree",
              "schedulefree.adamwschedulefree": "adamw_schedulefree", "bitsandbytes.optim.adamw8bit": "adamw8bit"}
SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear", "cosine": "cosine",
              "cosine_with_restarts": "cosine_with_restarts", "polynomial": "polynomial"}
LOSSES = {"l2": "mse", "huber": "huber", "l1": "l1"}
PRECISIONS = {"bf16": "bf16", "fp16": "fp16", "no": "fp32"}
FLUX_CONFIG = "black-forest-labs/FLUX.1-dev"  # the diffusers folder a lone FLUX transformer file needs beside it
SD3_CONFIG = "stabilityai/stable-diffusion-3.5-large"


def read_kohya(path: Path) -> Imported:
    args, gui = _read(path)
    imported = Imported(source=str(path))
    dataset = _dataset_config(args, path)
    family = _family(args, gui, imported)
    imported.set("model.family", family)
    used: set[str] = set()

    def take(key: str) -> Any:
        used.add(key)
        return args.get(key)

    _model(take, imported, family, args)
    _network(take, imported, family, gui)
    _training(take, imported, family, args)
    read_data(take, imported, args, dataset)  # before the warm-up: the run's length may come from its epochs
    _warmup(take, imported)
    _keep_tokens_only_with_shuffling(imported)
    for key, value in args.items():
        if key in used or key in IGNORED or not is_set(value):
            continue
        imported.skip(key, value, WHY.get(key, "no imagetune equivalent"))
    return imported


def _read(path: Path) -> tuple[dict, bool]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--import-kohya: cannot read {path} ({exc.strerror or exc}).") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            return data, True
        if path.suffix.lower() == ".toml":
            return _flatten(_toml(text)), False
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise UserError(f"--import-kohya: {path} is not valid {path.suffix[1:].upper()} ({exc}).") from None
    raise UserError(f"--import-kohya: {path} is neither a kohya_ss GUI config (.json) nor an sd-scripts config "
                    "(.toml).")


def _toml(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, as a package (a dependency there)
        import tomli as tomllib
    return tomllib.loads(text)


def _flatten(config: dict) -> dict:
    """sd-scripts merges every [section] of a --config_file into one namespace (read_config_from_file)."""
    if "datasets" in config:
        raise UserError("--import-kohya: this TOML is a dataset config ([[datasets]]); import the training config "
                        "that names it in `dataset_config` (or a kohya_ss GUI .json).")
    flat: dict = {}
    for name, value in config.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[name] = value
    return flat


def _dataset_config(args: dict, path: Path) -> dict | None:
    name = str(args.get("dataset_config") or "")
    if not is_set(name):
        return None
    for candidate in (path.parent / name, Path(name)):  # sd-scripts reads it from the working folder
        if candidate.is_file() and escapes(candidate):  # an exposed UI's import reads the workspace only
            raise UserError(f"--import-kohya: dataset_config {name!r} {OUTSIDE}; copy it into the workspace and "
                            "name it from there.")
        if candidate.is_file():
            try:
                return _toml(candidate.read_text(encoding="utf-8"))
            except ValueError as exc:
                raise UserError(f"--import-kohya: the dataset config {candidate} is not valid TOML ({exc}).") from None
    raise UserError(f"--import-kohya: dataset_config {name!r} was not found next to {path} or in the current "
                    "folder; put it there (its folders are the training images), then import again.")


def _family(args: dict, gui: bool, imported: Imported) -> str:
    module = str(args.get("network_module") or "")
    if args.get("flux1_checkbox") or "flux" in module or args.get("LoRA_type") == "Flux1":
        return "flux"
    if args.get("sd3_checkbox") or "sd3" in module:
        return "sd3"
    if args.get("sdxl"):
        return "sdxl"
    if gui:
        return "sd"
    # sd-scripts: the script, not the file, says the model; the files of each model's text encoders tell.
    has = {k for k in ("clip_l", "clip_g", "t5xxl", "ae") if is_set(args.get(k))}
    family = ("sd3" if {"clip_g", "t5xxl"} <= has else "flux" if has & {"ae", "t5xxl"} else
              "sdxl" if any(k.startswith("sdxl") for k in args) or "xl" in str(args.get("pretrained_model_name_or_path",
                                                                                         "")).lower() else "sd")
    imported.notes.append(f"model.family {family}: inferred from the file's keys (sd-scripts picks the model by "
                          "its script); change it if the run used another script")
    return family


def _model(take: Callable, imported: Imported, family: str, args: dict) -> None:
    path = take("pretrained_model_name_or_path")
    if is_set(path):
        imported.set("model.path", str(path))
        single = str(path).endswith((".safetensors", ".ckpt", ".sft"))
        if single and family in ("flux", "sd3"):
            config = FLUX_CONFIG if family == "flux" else SD3_CONFIG
            imported.set("model.config", config)
            imported.notes.append(f"model.config {config}: a lone {family} weights file needs the rest of the pipeline "
                                  "(text encoders, VAE, configs) from a diffusers folder or hub id; point it at a "
                                  "local copy to stay offline")
    for key in ("clip_l", "clip_g", "t5xxl", "ae", "vae"):
        value = take(key)
        if is_set(value) and not str(value).startswith("put the full path"):
            imported.skip(key, value, "imagetune loads the text encoders and VAE with the base model (model.path, or "
                                      "model.config beside a single file)")
    if take("v_parameterization"):
        imported.set("model.prediction_type", "v_prediction")
    if take("zero_terminal_snr"):
        imported.set("model.zero_terminal_snr", True)
    if take("fp8_base") or take("fp8_base_unet"):
        imported.set("model.base_weights", "fp8")


def _network(take: Callable, imported: Imported, family: str, gui: bool) -> None:
    kind, module = take("LoRA_type"), take("network_module")
    args = take("network_args")
    algo, factor_arg = "", None
    for item in args if isinstance(args, list) else str(args or "").split():
        name, _, value = str(item).partition("=")
        if name.strip() == "algo":
            algo = value.strip().lower()
        elif name.strip() == "factor" and integer(value) is not None:
            factor_arg = integer(value)
        elif is_set(item):
            imported.skip("network_args", item, "imagetune's adapters take lora.* keys only")
    kinds = {"Standard": "lora", "Flux1": "lora", "LyCORIS/LoKr": "lokr", "LyCORIS/LoHa": "loha"}
    if kind is not None and kind not in kinds:
        imported.skip("LoRA_type", kind, "imagetune trains LoRA, LoKr and LoHa (lora.type); LoRA is used")
    if module is not None and "lycoris" in str(module) and algo not in ("lokr", "loha"):
        imported.skip("network_module", module, f"LyCORIS algo {algo!r} is not one imagetune trains; LoRA is used")
    lora_type = kinds.get(kind or "", algo if algo in ("lokr", "loha") else "lora")
    if lora_type != "lora":
        imported.set("lora.type", lora_type)
    for theirs, ours in (("network_dim", "lora.rank"), ("network_alpha", "lora.alpha")):
        size = number(take(theirs))
        if size:
            imported.set(ours, int(size) if ours == "lora.rank" else size)
    factor = integer(take("factor")) if factor_arg is None else factor_arg  # the GUI's field, or LyCORIS' arg
    if lora_type == "lokr" and factor is not None:
        imported.set("lora.factor", factor)
    dropout = number(take("network_dropout"))
    if dropout:
        imported.set("lora.dropout", dropout)
    if take("dora_wd"):
        imported.set("lora.dora", True)
    weights = take("network_weights") or take("lora_network_weights")
    if is_set(weights):
        imported.set("lora.init_from", str(weights))
    unet_lr, te_lr = number(take("unet_lr")), number(take("text_encoder_lr"))
    if unet_lr:
        imported.set("train.lr", unet_lr)
    te_trained = not take("network_train_unet_only") and (te_lr is None or te_lr > 0) and family in ("sd", "sdxl")
    if gui and not te_lr:
        te_trained = False  # the GUI trains the U-Net only when the text encoder's rate is 0
    if te_trained:
        imported.set("lora.train_text_encoder", True)
        if te_lr:
            imported.set("train.text_encoder_lr", te_lr)
    elif family in ("flux", "sd3") and te_lr:
        imported.skip("text_encoder_lr", te_lr, f"imagetune trains {family}'s transformer only")


def _training(take: Callable, imported: Imported, family: str, args: dict) -> None:
    lr = number(take("learning_rate"))
    if lr and imported.get("train.lr") is None:
        imported.set("train.lr", lr)
    steps = integer(take("max_train_steps"))
    if steps:
        imported.set("train.steps", steps)
    optimizer = take("optimizer") or take("optimizer_type")
    if is_set(optimizer):
        ours = OPTIMIZERS.get(str(optimizer).lower())
        if ours:
            imported.set("train.optimizer", ours)
        else:
            theirs = "optimizer" if "optimizer" in args else "optimizer_type"
            imported.skip(theirs, optimizer, "not an imagetune optimizer (adamw, adamw8bit, sgd, prodigy, adafactor, "
                                             "adamw_schedulefree); adamw is used")
    _optimizer_args(take("optimizer_args"), imported)
    scheduler = take("lr_scheduler")
    if is_set(scheduler):
        if scheduler in SCHEDULERS:
            imported.set("train.scheduler", SCHEDULERS[scheduler])
        else:
            imported.skip("lr_scheduler", scheduler, "not an imagetune schedule; constant is used")
    cycles, power = integer(take("lr_scheduler_num_cycles")), number(take("lr_scheduler_power"))
    if cycles and cycles > 1:
        imported.set("train.scheduler_cycles", cycles)
    if power and scheduler == "polynomial":
        imported.set("train.scheduler_power", power)
    for theirs, ours in (("max_grad_norm", "train.max_grad_norm"), ("noise_offset", "train.noise_offset"),
                         ("ip_noise_gamma", "train.input_perturbation"), ("huber_c", "train.huber_delta")):
        value = number(take(theirs))
        if value is not None and (value or theirs == "max_grad_norm") and theirs in args:
            if theirs != "huber_c" or take("loss_type") == "huber":
                imported.set(ours, value)
    gamma = number(take("min_snr_gamma"))
    if gamma:
        if family in ("sd", "sdxl"):
            imported.set("train.min_snr_gamma", gamma)
        else:
            imported.skip("min_snr_gamma", gamma, f"{family} weights its loss with flow.weighting instead")
    loss = take("loss_type")
    if is_set(loss):
        if loss in LOSSES:
            if LOSSES[loss] != "mse":
                imported.set("train.loss", LOSSES[loss])
        else:
            imported.skip("loss_type", loss, "imagetune's losses are mse (l2), huber and l1")
    if take("gradient_checkpointing"):
        imported.set("train.gradient_checkpointing", True)
    _block_swap(take, imported, family)
    if take("torch_compile"):
        imported.set("train.compile", True)
    precision = take("mixed_precision")
    if precision in PRECISIONS:
        imported.set("precision", PRECISIONS[precision])
    seed = integer(take("seed"))
    if seed is not None:
        imported.set("seed", seed)
    xformers, sdpa = take("xformers"), take("sdpa")
    if xformers in (True, "xformers"):
        imported.set("attention", "xformers")
    elif sdpa or xformers == "sdpa":
        imported.set("attention", "sdpa")
    if is_set(take("output_name")):
        imported.set("name", str(args["output_name"]))
    every = integer(take("save_every_n_steps"))
    if every:
        imported.set("checkpoint.every", every)
    sample_every = integer(take("sample_every_n_steps"))
    if sample_every:
        imported.set("sample.every", sample_every)
    _sample_prompts(take("sample_prompts"), imported)
    _flow(take, imported, family)
    tracker = take("log_with")
    if tracker in ("tensorboard", "all"):
        imported.set("logging.tensorboard", True)
    if tracker in ("wandb", "all"):
        imported.set("logging.wandb", str(take("log_tracker_name") or "imagetune"))


def _keep_tokens_only_with_shuffling(imported: Imported) -> None:
    """kohya accepts keep_tokens without shuffle_caption (it then does nothing); imagetune refuses the pair."""
    data = imported.preset.get("data", {})
    for place in [data, *data.get("datasets", [])]:
        if place.get("keep_tokens") is not None and not place.get("shuffle_tags", data.get("shuffle_tags")):
            del place["keep_tokens"]


def _warmup(take: Callable, imported: Imported) -> None:
    warmup, percent = number(take("lr_warmup_steps")), number(take("lr_warmup"))
    total = imported.get("train.steps")
    if warmup and warmup < 1 and total:  # sd-scripts: a fraction of the steps
        warmup = warmup * total
    elif not warmup and percent and total:  # the GUI: a percentage
        warmup = percent / 100 * total
    if warmup:
        imported.set("train.warmup_steps", int(warmup))


def _optimizer_args(value: Any, imported: Imported) -> None:
    items = value if isinstance(value, list) else str(value or "").split()
    for item in items:
        name, _, raw = str(item).partition("=")
        name = name.strip()
        if name == "weight_decay" and number(raw) is not None:
            imported.set("train.weight_decay", number(raw))
        elif name == "eps" and number(raw) is not None:
            imported.set("train.eps", number(raw))
        elif name == "betas":
            betas = [number(b) for b in raw.strip("()[] ").split(",")]
            if len(betas) == 2 and None not in betas:
                imported.set("train.betas", betas)
        else:
            imported.skip("optimizer_args", item, "imagetune sets only weight_decay, betas and eps of its optimizers")


def _sample_prompts(value: Any, imported: Imported) -> None:
    """sd-scripts' prompt file: one prompt per line, options after ` --` (size, seed, steps)."""
    if not is_set(value):
        return
    path = Path(str(value))
    if path.suffix.lower() in (".txt", "") and path.is_file() and not escapes(path):
        prompts = [line.split(" --")[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
        prompts = [p for p in prompts if p and not p.startswith("#")]
        if prompts:
            imported.set("sample.prompts", prompts)
            return
    imported.skip("sample_prompts", value, "imagetune reads prompts from sample.prompts; the file was not found or "
                                           "is not a .txt prompt list")


def _flow(take: Callable, imported: Imported, family: str) -> None:
    sampling, shift = take("timestep_sampling"), number(take("discrete_flow_shift"))
    guidance = number(take("guidance_scale"))
    if family not in ("flux", "sd3"):
        return
    if sampling in ("sigma", "uniform"):
        imported.set("flow.timestep_sampling", "uniform")
    elif sampling == "shift" and shift:
        imported.set("flow.shift", shift)
    elif sampling not in (None, "", "sigmoid", "flux_shift"):
        imported.skip("timestep_sampling", sampling, "imagetune samples logit_normal (sigmoid) or uniform")
    scale = number(take("sigmoid_scale"))
    if scale and scale != 1:
        imported.set("flow.logit_std", scale)
    weighting = take("weighting_scheme")
    if weighting in ("sigma_sqrt", "cosmap"):
        imported.set("flow.weighting", weighting)
    elif weighting == "logit_normal":
        mean, std = number(take("logit_mean")), number(take("logit_std"))
        if mean:
            imported.set("flow.logit_mean", mean)
        if std and std != 1:
            imported.set("flow.logit_std", std)
    prediction = take("model_prediction_type")
    if prediction not in (None, "", "raw"):
        imported.skip("model_prediction_type", prediction, "imagetune trains the raw flow-matching prediction")
    if family == "flux" and guidance is not None:
        imported.set("flow.guidance", guidance)
    length = integer(take("t5xxl_max_token_length"))
    if length:
        imported.set("flow.max_sequence_length", length)


def _block_swap(take, imported: Imported, family: str) -> None:
    """sd-scripts' `blocks_to_swap` N counts its own units (for FLUX.1 a double block as two single ones, its
    `flux_train_network.py`), so N is not a count of this model's blocks: `auto` swaps the fewest that fit the GPU,
    which is what N was chosen for. Block swap needs gradient checkpointing here, as there."""
    from trainer.core.registry import spec_of

    swap = integer(take("blocks_to_swap"))
    if not swap:
        return
    if not spec_of(family).block_lists:
        imported.skip("blocks_to_swap", swap, f"{family} has no blocks imagetune swaps (the flow-matching "
                                              "transformers only)")
        return
    imported.set("model.block_swap", "auto")
    imported.set("train.gradient_checkpointing", True)
    imported.notes.append(f"model.block_swap auto: sd-scripts swapped {swap} of its block units; auto swaps the "
                          "fewest of this model's blocks that fit the GPU (hardware.gpu_memory_gb where the GPU is "
                          "not in this machine)")

