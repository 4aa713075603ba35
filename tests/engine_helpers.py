"""Run the real engine (launcher -> torchrun -> worker) on the tiny model, and read what it left."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.core.checkpoint import latest_checkpoint
from trainer.core.config import load_config
from trainer.core.events import read_events
from trainer.core.launcher import prepare_run, start_run
from trainer.core.hardware import CPU_ONLY

BASE = [
    "precision=fp32", "batch.total=4", "train.steps=4", "train.lr=1e-3", "train.scheduler=cosine",
    "train.warmup_steps=1", "sample.every=0", "checkpoint.every=0", "data.resolution=64", "data.flip=true",
    "lora.rank=4", "lora.alpha=8",
]


def engine_config(model: Path, data: Path, *overrides: str):
    return load_config(None, [f"model.path={model}", f"data.path={data}", *BASE, *overrides])


def launch(runs_dir: Path, config, *, until=None, action=None, timeout: float = 300):
    """Start a run; when `until(events)` becomes true, call `action(run_process)`; return (run_dir, final)."""
    run_dir, plan = prepare_run(config, runs_dir, hw=CPU_ONLY)
    proc = start_run(run_dir, plan, config)
    deadline = time.time() + timeout
    while until is not None and proc.poll() is None and time.time() < deadline:
        if until(read_events(run_dir)):
            action(proc)
            break
        time.sleep(0.2)
    final = proc.wait(timeout=max(1.0, deadline - time.time()))
    return run_dir, final


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
