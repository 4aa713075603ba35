"""Semantic checks of a typed Config: ranges, paths and combinations. Returns every problem, raises nothing.

Checks that depend on the machine (GPU count, bf16 support, xformers, bitsandbytes) live in `trainer.core.plan`.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainer.core.config.bounds import bound_problems
from trainer.core.config.extras import missing_extra_problems
from trainer.core.config.lora_checks import lora_problems
from trainer.core.compiling import compile_problems
from trainer.core.config.schema import Config, ModelConfig
from trainer.core.config.shape_words import COLOURS, SHAPES
from trainer.core.registry import SPECS

DEMO_SCHEME = "demo://"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CPU_DEVICES = re.compile(r"^cpu(:(\d+))?$")


# The keys that name a model, the only ones a hub id may fill. Any other path key (class images, masks, data) is a
# local path even when it looks like `org/name`: read as a hub id it would skip the workspace check and stay
# relative in the run's config.yaml (issue 29: `prior.class_path: link_out/created` wrote outside the workspace).
HUB_ID_KEYS = ("model.path", "model.config", "detection.weights")


def is_hub_id(path: str) -> bool:
    """`org/name` that is not a local path: diffusers fetches it from the Hugging Face hub."""
    return bool(_HUB_ID.match(path)) and not Path(path).exists()


def hub_id_at(key: str, value) -> bool:
    """Whether `value` of config key `key` is a hub id: only a model key may hold one, and not when its first
    part exists here (`link/new` through a symlink `link` is a local path that does not exist yet)."""
    if key not in HUB_ID_KEYS or not isinstance(value, str) or not is_hub_id(value):
        return False
    return not Path(value.split("/", 1)[0]).exists()


def _positive(problems: list[str], key: str, value, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        kind = "zero or more" if allow_zero else "greater than zero"
        problems.append(f"{key}: must be {kind}, got {value}")


def parse_devices(devices) -> tuple[str, int | list[int] | None]:
    """Normalise `devices` to ("auto", None) | ("gpus", count:int) | ("gpu_ids", [ids]) | ("cpu", n).

    Raises ValueError with a message naming the accepted forms.
    """
    if isinstance(devices, bool):
        raise ValueError("devices: expected auto, a GPU count, a list of GPU ids or cpu:N")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices: a GPU count must be 1 or more, got {devices}")
        return "gpus", devices
    if isinstance(devices, (list, tuple)):
        if not devices or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            raise ValueError(f"devices: a list must hold GPU ids like [0, 1], got {list(devices)}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices: GPU ids repeat in {list(devices)}")
        return "gpu_ids", list(devices)
    text = str(devices).strip().lower()
    if text == "auto":
        return "auto", None
    if text.isdigit():
        return parse_devices(int(text))
    match = _CPU_DEVICES.match(text)
    if match:
        count = int(match.group(2) or 1)
        if count < 1:
            raise ValueError("devices: cpu:N needs N of 1 or more")
        return "cpu", count
    if re.fullmatch(r"\d+(,\d+)+", text):
        return parse_devices([int(t) for t in text.split(",")])
    raise ValueError(f"devices: {devices!r} is not auto, a GPU count (2), a list of GPU ids ([0, 1]) or cpu:N")


def validate(config: Config, *, check_paths: bool = True) -> list[str]:
    p: list[str] = []
    t, b = config.train, config.batch
    _positive(p, "train.steps", t.steps)
    _positive(p, "train.lr", t.lr)
    _positive(p, "train.text_encoder_lr", t.text_encoder_lr)
    _positive(p, "train.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive(p, "train.max_grad_norm", t.max_grad_norm, allow_zero=True)
    _positive(p, "train.noise_offset", t.noise_offset, allow_zero=True)
    _positive(p, "train.min_snr_gamma", t.min_snr_gamma)
    _positive(p, "train.weight_decay", t.weight_decay, allow_zero=True)
    _positive(p, "train.max_nonfinite_steps", t.max_nonfinite_steps)
    _positive(p, "train.scheduler_cycles", t.scheduler_cycles)
    _positive(p, "train.scheduler_power", t.scheduler_power)
    p += _logging_problems(config.logging)
    p += _hub_problems(config)
    p += _optimizer_problems(t)
    if len(t.betas) != 2 or not all(0 <= x < 1 for x in t.betas):
        p.append(f"train.betas: must be two numbers in [0, 1), got {t.betas}")
    _positive(p, "batch.total", b.total)
    if isinstance(b.per_device, str):
        if b.per_device != "auto":
            p.append(f"batch.per_device: must be a positive integer or auto, got {b.per_device!r}")
    else:
        _positive(p, "batch.per_device", b.per_device)
    workers = config.data.workers
    if isinstance(workers, str) and workers != "auto" or isinstance(workers, int) and workers < 0:
        p.append(f"data.workers: must be auto or a whole number of input processes (0 or more), got {workers!r}")
    spec = _spec(config.model.family)
    p += spec.check(config, check_paths=check_paths,
                    edit_families=tuple(name for name, other in SPECS.items() if other.control_images))
    res, multiple = config.data.resolution, spec.resolution_multiple
    if multiple and (res < multiple or res % multiple):
        p.append(f"data.resolution: must be a multiple of {multiple} (the VAE downsamples by {multiple}), "
                 f"got {res}")
    sample_multiple = spec.bucket_multiple or multiple
    for side in ("size", "width", "height"):
        value = getattr(config.sample, side)
        if value is not None and sample_multiple and (value < sample_multiple or value % sample_multiple):
            p.append(f"sample.{side}: must be a multiple of {sample_multiple} for {config.model.family}, got {value}")
    if config.data.bucketing and spec.bucket_multiple:
        p += _bucket_problems(config, spec.bucket_multiple)
    lora = config.lora
    if config.method == "lora":
        _positive(p, "lora.rank", lora.rank)
        _positive(p, "lora.alpha", lora.alpha)
        if not 0 <= lora.dropout < 1:
            p.append(f"lora.dropout: must be in [0, 1), got {lora.dropout}")
        if not lora.unet_targets:
            p.append("lora.unet_targets: needs at least one module name, e.g. [to_q, to_k, to_v, to_out.0]")
    p += lora_problems(config, check_paths=check_paths)
    p += compile_problems(config)
    p += missing_extra_problems(config)
    base_weights = config.model.base_weights
    if base_weights != "bf16" and config.method != "lora":
        p.append(f"model.base_weights: {base_weights} is for LoRA on the diffusion families (a full fine-tune "
                 "trains every weight in fp32); set model.base_weights=bf16")
    elif base_weights == "fp8" and not config.train.gradient_checkpointing and config.model.fp8_compute != "on":
        p.append("model.base_weights: fp8 saves memory only with train.gradient_checkpointing=true (otherwise "
                 "each layer's upcast weights are kept for the backward pass): set it, or base_weights=bf16, or "
                 "model.fp8_compute=on on GPUs of compute capability 8.9+ (nothing is upcast there)")
    if config.hardware.gpu_memory_gb < 0:
        p.append(f"hardware.gpu_memory_gb: the memory of the card the preset is for, in GB (24 for an RTX 4090), or 0 "
                 f"for none; got {config.hardware.gpu_memory_gb:g}")
    if config.hardware.gpus < 0:
        p.append(f"hardware.gpus: how many of those cards the preset is for (8 for an 8-GPU node), or 0 for one; got "
                 f"{config.hardware.gpus}")
    swap = config.model.block_swap
    if swap != "auto" and (isinstance(swap, str) or isinstance(swap, bool) or swap < 0):
        p.append(f"model.block_swap: a number of blocks (0 or more) or auto, got {swap!r}")
    else:
        swap_problem = spec.block_swap_problem(config)
        if swap_problem:
            p.append(swap_problem)
    if config.model.fp8_compute == "on" and base_weights != "fp8":
        p.append("model.fp8_compute: on multiplies with the fp8 base weights, and model.base_weights is "
                 f"{base_weights}: set model.base_weights=fp8 too, or model.fp8_compute=auto")
    if config.train.channels_last == "on" and (config.method != "lora" or not spec.channels_last):
        p.append("train.channels_last: on is for LoRA runs of the UNet families (sd, sdxl): a full fine-tune saves "
                 "its weights in the standard layout and SD3 / FLUX / detection are not stored channels-last here; "
                 "set train.channels_last=auto")
    if config.distributed.zero_stage not in (1, 2):
        p.append(f"distributed.zero_stage: 1 or 2, got {config.distributed.zero_stage} (for sharded weights, ZeRO-3, "
                 "use distributed.sharding=fsdp)")
    if config.method == "full" and not 0 < config.full.ema_decay < 1:
        p.append(f"full.ema_decay: must be between 0 and 1, got {config.full.ema_decay}")
    _positive(p, "sample.every", config.sample.every, allow_zero=True)
    _positive(p, "sample.steps", config.sample.steps)
    _positive(p, "checkpoint.every", config.checkpoint.every, allow_zero=True)
    _positive(p, "eval.every", config.eval.every, allow_zero=True)
    _positive(p, "checkpoint.keep", config.checkpoint.keep)
    if not all(isinstance(x, str) and x.strip() for x in config.sample.prompts):
        p.append("sample.prompts: must be a list of non-empty strings")
    _positive(p, "sample.images_per_prompt", config.sample.images_per_prompt)
    _scored_prompts(p, config)
    d = config.distributed
    _positive(p, "distributed.nodes", d.nodes)
    _positive(p, "distributed.timeout_s", d.timeout_s)
    _positive(p, "distributed.stall_warning_s", d.stall_warning_s)
    _positive(p, "distributed.stall_timeout_s", d.stall_timeout_s, allow_zero=True)
    if d.stall_warning_s and d.stall_timeout_s and d.stall_timeout_s <= d.stall_warning_s:
        p.append(f"distributed.stall_timeout_s: {d.stall_timeout_s:g} ends the run before the warning at "
                 f"distributed.stall_warning_s={d.stall_warning_s:g}; make it larger, or 0 to never end the run")
    if not 0 <= d.node_rank < max(d.nodes, 1):
        p.append(f"distributed.node_rank: must be in 0..{d.nodes - 1}, got {d.node_rank}")
    if not 1 <= d.master_port <= 65535:
        p.append(f"distributed.master_port: must be a TCP port (1-65535), got {d.master_port}")
    try:
        parse_devices(config.devices)
    except ValueError as exc:
        p.append(str(exc))
    p += bound_problems(config)
    prior = config.prior
    if prior.enabled:
        if not prior.class_prompt.strip():
            p.append("prior.class_prompt: prior preservation needs a class prompt, e.g. 'a photo of a dog'")
        if not prior.class_path:
            p.append("prior.class_path: prior preservation needs a folder for class images (it may be empty)")
        _positive(p, "prior.num_class_images", prior.num_class_images)
        _positive(p, "prior.loss_weight", prior.loss_weight)
    return p


def _spec(family: str):
    """The family's spec. An unknown family (reported by build_config) is checked as the default family, so
    the user still sees every other problem at once."""
    return SPECS.get(family) or SPECS[ModelConfig().family]


def _bucket_problems(config: Config, multiple: int) -> list[str]:
    d, p = config.data, []
    if d.bucket_step < 8 or d.bucket_step % 8:
        p.append(f"data.bucket_step: must be a multiple of 8 (the VAE downsamples by 8), got {d.bucket_step}")
    elif d.bucket_step % multiple:
        p.append(f"data.bucket_step: {config.model.family} needs bucket sides that are multiples of {multiple} "
                 f"(its transformer packs 2x2 latent patches); got {d.bucket_step} (64 is usual)")
    if not d.bucket_max_aspect >= 1:
        p.append(f"data.bucket_max_aspect: must be 1 or more (long side / short side), got {d.bucket_max_aspect}")
    for name in ("bucket_min_side", "bucket_max_side"):
        value = getattr(d, name)
        if value is not None and (value < 8 or value % 8):
            p.append(f"data.{name}: must be a positive multiple of 8, got {value}")
    lo, hi = d.bucket_min_side, d.bucket_max_side
    if lo is not None and hi is not None and lo > hi:
        p.append(f"data.bucket_min_side ({lo}) is larger than data.bucket_max_side ({hi})")
    if lo is not None and lo > d.resolution:
        p.append(f"data.bucket_min_side: {lo} is larger than data.resolution {d.resolution}: no bucket fits")
    if hi is not None and d.bucket_step > 0 and hi < d.resolution // d.bucket_step * d.bucket_step:
        p.append(f"data.bucket_max_side: {hi} is smaller than data.resolution {d.resolution}: no square bucket")
    if not p and d.resolution < d.bucket_step:
        p.append(f"data.bucket_step: {d.bucket_step} is larger than data.resolution {d.resolution}")
    return p


# logging.wandb: `project` or `entity/project`; W&B refuses these characters in both.
_WANDB_NAME = re.compile(r"^[^/\\#?%:\s]{1,128}(/[^/\\#?%:\s]{1,128})?$")


def _hub_problems(config: Config) -> list[str]:
    """output.push_to_hub: a repo id the Hub accepts, and a token to upload with (found now, not after training)."""
    repo = config.output.push_to_hub
    if repo is None:
        return []
    if not _HUB_ID.match(repo) or len(repo) > 96 or "--" in repo or ".." in repo:
        return [f"output.push_to_hub: {repo!r} is not a Hub repo id: give `user/name` or `org/name` (letters, digits, "
                "-, _ and .)"]
    refused = SPECS[config.model.family].hub_upload_note
    if refused:
        return [f"output.push_to_hub: {refused}"]
    from huggingface_hub import get_token  # torch-free; a dependency

    if not get_token():
        return ["output.push_to_hub: no Hugging Face token: set HF_TOKEN (a write token) in the environment or run "
                "`hf auth login`, or leave output.push_to_hub unset"]
    return []


def _logging_problems(log) -> list[str]:
    """logging.wandb: a project W&B accepts (the packages both sinks need are extras: trainer.core.config.extras)."""
    if log.wandb is not None and not _WANDB_NAME.match(log.wandb):
        return [f"logging.wandb: {log.wandb!r} is not a W&B project: give `project` or `entity/project` (no spaces, "
                "no / \\ # ? % :, at most 128 characters each)"]
    return []


def _optimizer_problems(t) -> list[str]:
    p = []
    if t.optimizer == "adamw_schedulefree" and t.scheduler != "constant":
        p.append(f"train.scheduler: {t.scheduler} with train.optimizer=adamw_schedulefree, which replaces the decay "
                 "schedule by averaging: set train.scheduler=constant (train.warmup_steps still warms it up)")
    return p



def _scored_prompts(p: list[str], config: Config) -> None:
    """sample.concept / sample.control: a prompt and what the shapes judge must see, both or neither."""
    words = {*COLOURS, *SHAPES}
    for name in ("concept", "control"):
        scored = getattr(config.sample, name)
        if bool(scored.prompt.strip()) != bool(scored.shows.strip()):
            p.append(f"sample.{name}: set both `prompt` and `shows` (what its samples must show), or neither")
            continue
        unknown = [w for w in scored.shows.split() if w not in words]
        if unknown:
            p.append(f"sample.{name}.shows: the shapes judge does not read {', '.join(map(repr, unknown))}; it reads "
                     f"the colours {', '.join(COLOURS)} and the shapes {', '.join(SHAPES)} (it scores the offline "
                     "demo's world only)")
