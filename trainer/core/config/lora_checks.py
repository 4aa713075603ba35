"""Checks of the `lora` section's adapter keys (lora.type, factor, dora, init_from, ema): each problem a sentence
naming the key, the value and the way out. Called by `validate`; returns problems, raises nothing."""

from __future__ import annotations

from pathlib import Path

from trainer.core.config.schema import Config

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"


def init_file(value: str) -> Path:
    """The file `lora.init_from` names: the file itself, or a diffusers LoRA folder's weights file."""
    path = Path(value).expanduser()
    return path / DIFFUSERS_LORA_FILE if path.is_dir() else path


def lora_problems(config: Config, *, check_paths: bool = True) -> list[str]:
    lora = config.lora
    p: list[str] = []
    if config.method != "lora":
        return p
    if lora.factor != -1 and lora.factor < 1:
        p.append(f"lora.factor: -1 (split each side near its square root) or a positive divisor, got {lora.factor}")
    elif lora.factor != -1 and lora.type != "lokr":
        p.append(f"lora.factor: {lora.factor} splits LoKr's Kronecker factors and lora.type is {lora.type}: set "
                 "lora.type=lokr, or leave lora.factor at -1")
    if lora.dora and lora.type != "lora":
        p.append(f"lora.dora: DoRA decomposes a LoRA (peft has it for lora.type=lora only), and lora.type is "
                 f"{lora.type}: set lora.type=lora or lora.dora=false")
    if lora.dora and config.model.base_weights != "bf16":
        p.append(f"lora.dora: DoRA renormalises each adapted weight by its full-precision norm, which "
                 f"model.base_weights={config.model.base_weights} does not keep: set model.base_weights=bf16 or "
                 "lora.dora=false")
    if lora.dora and lora.train_text_encoder:
        p.append("lora.dora: diffusers' LoRA loader drops a text encoder's DoRA magnitudes, so the run's diffusers "
                 "file would not load to what it trained: set lora.train_text_encoder=false with DoRA (or "
                 "lora.dora=false)")
    if lora.type != "lora" and lora.dropout:
        p.append(f"lora.dropout: {lora.dropout} is LoRA's dropout; peft's {lora.type} has none: set lora.dropout=0 "
                 "or lora.type=lora")
    if lora.ema and not 0 < lora.ema_decay < 1:
        p.append(f"lora.ema_decay: must be between 0 and 1, got {lora.ema_decay}")
    if lora.init_from:
        p += _init_from_problems(config, check_paths=check_paths)
    return p


def _init_from_problems(config: Config, *, check_paths: bool) -> list[str]:
    lora = config.lora
    if lora.type != "lora":
        return [f"lora.init_from: starts a LoRA from a LoRA file; lora.type={lora.type} has no exact form of a LoRA's "
                "update to start from: set lora.type=lora, or leave lora.init_from empty"]
    if not check_paths:
        return []
    file = init_file(lora.init_from)
    if not file.is_file():
        where = (f"the folder '{lora.init_from}' holds no {DIFFUSERS_LORA_FILE}" if Path(lora.init_from).is_dir()
                 else f"'{lora.init_from}' does not exist")
        return [f"lora.init_from: {where}; give a LoRA .safetensors file (kohya or diffusers keys) or a run's "
                "output/ folder"]
    if file.suffix != ".safetensors":
        return [f"lora.init_from: '{file}' is not a .safetensors file; LoRA files are read as safetensors only (a "
                "pickled .ckpt/.bin could run code): convert it, or give the .safetensors one"]
    return []
