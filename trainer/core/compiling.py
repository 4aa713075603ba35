"""`train.compile` before any process starts (torch-free): what cannot be compiled, refused with the reason, and
the plan's note on the shapes the blocks will compile for. The compiling itself is trainer.engine.compile."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config package's validation imports this module
    from trainer.core.config.schema import Config

KEY = "train.compile"


def compile_problems(config: Config) -> list[str]:
    """What the config cannot compile, whatever the machine (detection refuses it in its own checks)."""
    if not config.train.compile:
        return []
    if config.model.base_weights == "fp8":
        return [f"{KEY}: does not work with model.base_weights=fp8: diffusers' layerwise casting upcasts each "
                "layer's float8 weights in hooks that torch.compile cannot trace (it breaks the graph at every layer "
                "and runs out of recompiles), and the recomputation of gradient checkpointing, which fp8 needs, then "
                "sees float8 where the forward pass saved the upcast weights and fails. Set train.compile=false, or "
                "model.base_weights=nf4 (torchao's NF4 compiles) or bf16."]
    return []


def sharding_problem(config: Config, sharding: str, chosen: bool) -> str | None:
    """Why the plan's sharding cannot run compiled blocks (`chosen`: sharding auto picked it), or None."""
    if not config.train.compile or sharding == "ddp":
        return None
    why = " (chosen by distributed.sharding=auto: the full fine-tune does not fit on one GPU)" if chosen else ""
    if sharding == "fsdp":
        return (f"{KEY}: not supported with distributed.sharding=fsdp{why}: FSDP2 gathers and frees each block's "
                "weights in hooks around the very blocks train.compile compiles, a combination this trainer does not "
                "test. Set train.compile=false, or distributed.sharding=ddp if the model fits on one GPU.")
    return (f"{KEY}: not supported with distributed.sharding={sharding}{why}: DeepSpeed's engine wraps the network "
            "and reduces its gradients in hooks of its own, a combination with compiled blocks this trainer does not "
            "test. Set train.compile=false, or distributed.sharding=ddp.")


def toolchain_problem(config: Config, device: str) -> str | None:
    """torch.compile builds its kernels with a compiler of this machine: inductor's C++ on the CPU (`CXX`, else
    g++), Triton's C launchers on GPUs (`CC`, else gcc or clang). Without one every rank would fail at its first
    step with a traceback; said here instead."""
    import os
    import shutil

    if not config.train.compile:
        return None
    if device == "cpu":
        found, needs, install = shutil.which(os.environ.get("CXX") or "g++"), "a C++ compiler (g++, or CXX)", "g++"
    else:
        cc = os.environ.get("CC")  # Triton's own search: CC, else gcc, else clang
        found = shutil.which(cc) if cc else shutil.which("gcc") or shutil.which("clang")
        needs, install = "a C compiler for Triton (gcc or clang, or CC)", "gcc"
    if found:
        return None
    return (f"{KEY}: torch.compile builds its kernels on this machine and needs {needs}, which was not found. "
            f"Install one (Debian/Ubuntu: `apt-get install {install}`) or set train.compile=false.")


def compile_note(config: Config, per_device: int, buckets: tuple[tuple[int, int, int], ...] = ()) -> str | None:
    """The plan's note: the shapes the blocks compile for, each once (static shapes), when train.compile is on."""
    if not config.train.compile:
        return None
    data, sample = config.data, config.sample
    training = [f"{w}x{h}" for w, h, _ in buckets] or [f"{data.resolution}x{data.resolution}"]
    if data.bucketing and not buckets:
        training = [f"each aspect-ratio bucket of about {data.resolution}x{data.resolution}"]
    width = sample.width or sample.size or (buckets[0][0] if buckets else data.resolution)
    height = sample.height or sample.size or (buckets[0][1] if buckets else data.resolution)
    samples = sample.prompts or sample.concept.prompt or sample.control.prompt
    without = ([f"samples at {width}x{height}"] if samples else []) + (
        ["the validation loss"] if data.val_split or data.val_path else [])
    return (f"{KEY}: the network's repeated blocks are compiled (regional, static shapes), once per input shape: "
            f"training at {', '.join(training)} (micro-batch {per_device})"
            + (f"; without gradients, {' and '.join(without)}" if without else "")
            + "; a step that compiles is left out of samples/s and a warning event gives its compile time")
