"""A run's output files: where a checkpoint's export goes, and what loads each file. Torch-free: the command
line, the worker and the web UI all label outputs through this.

A finished run writes `output/`; an export of checkpoint step N (`launch.py --export`, `checkpoint.export`, the
UI's Export button) writes `output/step-NNNNNN/`, the same files for that step. A folder per step, not output/
itself: exports of several checkpoints sit side by side to be compared, none overwrites the finished run's files,
and a run resumed to the end still writes output/ as it always has.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainer.core.checkpoint import Checkpoint, complete_checkpoints
from trainer.core.runfolder import RunFolder
from trainer.errors import UserError

_EXPORT = re.compile(r"^step-(\d{6,})$")

# (how the name looks, what loads it): the first match labels a file or folder.
_LABELS: tuple[tuple[str, str], ...] = (
    ("pytorch_lora_weights.safetensors", "diffusers: pipe.load_lora_weights(folder)"),
    ("*_kohya.safetensors", "ComfyUI / A1111 / Forge: a LoRA file (models/loras/), kohya layout"),
    ("diffusers", "diffusers: DiffusionPipeline.from_pretrained(folder)"),
    ("model.safetensors", "imagetune: trainer.detect.load_detector(path) (final weights)"),
    ("best.safetensors", "imagetune: trainer.detect.load_detector(path) (best evaluation)"),
    ("transformers", "transformers: pipeline('object-detection', model=folder)"),
    ("transformers-best", "transformers: pipeline('object-detection', model=folder) (best evaluation)"),
    ("unet", "peft: PeftModel.from_pretrained(base.unet, folder) (LoKr/LoHa adapter)"),
    ("text_encoder*", "peft: PeftModel.from_pretrained(base text encoder, folder) (LoKr/LoHa adapter)"),
    ("transformer", "peft: PeftModel.from_pretrained(base.transformer, folder) (LoKr/LoHa adapter)"),
    ("README.md", "how to load these files"),
    ("*.safetensors", "ComfyUI / A1111 / Forge: a single-file checkpoint (models/checkpoints/)"),
)


def export_dir(run_dir: str | Path, step: int) -> Path:
    return RunFolder(Path(run_dir)).output / f"step-{step:06d}"


def exported_steps(run_dir: str | Path) -> list[int]:
    """Steps whose export is complete (a folder being written is still named `.tmp-…`), oldest first."""
    root = RunFolder(Path(run_dir)).output
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _EXPORT.match(p.name)))


def label(path: str | Path) -> str:
    """What loads this output file or folder (by its name, as the families write them)."""
    name = Path(path).name
    for pattern, text in _LABELS:
        if Path(name).match(pattern):
            return text
    return "—"


def labelled(paths, root: str | Path | None = None) -> list[str]:
    """`path  <- what loads it` lines for printing (paths shown relative to `root` when given)."""
    lines = []
    for p in paths:
        shown = Path(p).relative_to(root) if root is not None and Path(p).is_relative_to(root) else Path(p)
        lines.append(f"{shown}  <- {label(p)}")
    return lines


def pick_checkpoint(run_dir: Path, step: int | None) -> Checkpoint:
    found = complete_checkpoints(run_dir)
    if not found:
        raise UserError(f"Run {run_dir} has no complete checkpoint to export (checkpoints/step-NNNNNN/ with a "
                        "COMPLETE marker): it ended before its first one. Set checkpoint.every, or Stop a run (which "
                        "saves one), then export.")
    if step is None:
        return found[-1]
    for ckpt in found:
        if ckpt.step == step:
            return ckpt
    steps = ", ".join(str(c.step) for c in found)
    raise UserError(f"Run {run_dir} has no checkpoint of step {step}; --step can be one of: {steps} "
                    "(or leave --step out for the newest).")
