"""Run the real engine (launcher -> torchrun -> worker) on the tiny model, and read what it left."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.core.launcher import prepare_run, start_run
from trainer.core.hardware import CPU_ONLY
from trainer.engine.faults import ENV

BASE = [
    "precision=fp32", "batch.total=4", "train.steps=4", "train.lr=1e-3", "train.scheduler=cosine",
    "train.warmup_steps=1", "sample.every=0", "checkpoint.every=0", "data.resolution=64", "data.flip=true",
    "lora.rank=4", "lora.alpha=8",
]


def engine_config(model: Path, data: Path, *overrides: str):
    return load_config(None, [f"model.path={model}", f"data.path={data}", *BASE, *overrides])


def launch(runs_dir: Path, config, *, fault: str | None = None, timeout: float = 300):
    """Start a run and wait for it; return (run_dir, final event). `fault` is IMAGETUNE_FAULT for this launch
    only (trainer.engine.faults): a stop or a crash at an exact step, so a resume of the run does not repeat it."""
    run_dir, plan = prepare_run(config, runs_dir, hw=CPU_ONLY)
    with pytest.MonkeyPatch.context() as env:
        if fault is not None:
            env.setenv(ENV, fault)
        proc = start_run(run_dir, plan, config)
    return run_dir, proc.wait(timeout=timeout)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(latest_checkpoint(run_dir).path / "trainable.safetensors"))


def progress(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["type"] == "progress"]


def assert_same_weights(a: dict, b: dict, *, rtol=1e-5, atol=1e-6) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_lora_loaded(pipe, trained: dict) -> None:
    """After `pipe.load_lora_weights(output/)`: the pipeline's LoRA layers hold exactly the run's trained weights
    (`trained`: a checkpoint's "<component>.<path>.lora_A.<adapter>.weight"; adapter names differ, diffusers
    picks its own)."""
    def key(name: str) -> str:
        return re.sub(r"\.(lora_[AB])\.[^.]+\.weight$", r".\1.weight", name)

    components = {name.split(".")[0] for name in trained}
    loaded = {f"{component}.{key(name)}": p for component in components
              for name, p in getattr(pipe, component).named_parameters() if "lora_" in name}
    expected = {key(name): value for name, value in trained.items()}
    assert loaded.keys() == expected.keys() and len(expected) > 0
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, msg=lambda m: f"{name}: {m}")


def log_of(run_dir: Path) -> str:
    return (run_dir / "train.log").read_text(errors="replace")
