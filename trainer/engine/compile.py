"""`train.compile`: regional compilation of the trained network's repeated blocks with torch.compile.

Why regional: the blocks a network repeats (a UNet's transformer blocks, SD3's joint blocks, FLUX's 57 double and
single blocks) share their code, so one compiled graph serves every block of the same shapes, and compiling them
costs a fraction of compiling the whole network for most of its speed-up (PyTorch's regional compilation recipe;
diffusers' `compile_repeated_blocks`, whose `_repeated_blocks` lists this reads). Each block is compiled in place
(`module.compile()`), so the module tree, the parameter names, checkpoints, DDP's wrapper and the samples'
pipeline stay what they were; it happens after the adapters are added (the worker calls `compile_network` after
`family.load()`), so the LoRA / LoKr / LoHa layers inside a block are part of its graph.

Shapes are static (`dynamic=False`): the blocks compile once per input shape (each aspect-ratio bucket at the
micro-batch, and the no_grad passes of samples and the validation loss), and torch._dynamo's recompile limit (8
per function by default, after which it runs the function eagerly without a word) is raised so that every shape
of the run stays compiled. Every compile is reported in a `warning` event with the seconds it took, and the loop
leaves a step during which something compiled out of samples/s (`RegionalCompile.compiled`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# The blocks compiled per network class when diffusers lists none (`_repeated_blocks` is empty for SD3 in diffusers
# 0.42, and older diffusers have no lists at all): the blocks diffusers names for the others, and SD3's.
BLOCKS = {
    "UNet2DConditionModel": ("BasicTransformerBlock",),
    "SD3Transformer2DModel": ("JointTransformerBlock",),
    "FluxTransformer2DModel": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
}


class NoCompile:
    """What the loop asks after every step (`compiled`); this one is a run without train.compile: nothing compiles."""

    def compiled(self, step: int) -> bool:
        return False

    def phase(self, phase: str) -> str:
        """What this rank's heartbeat says it is doing (trainer.engine.heartbeat)."""
        return phase


def block_names(network: nn.Module) -> tuple[str, ...]:
    """The class names of `network`'s repeated blocks: diffusers' own list, else ours."""
    return tuple(getattr(network, "_repeated_blocks", None) or BLOCKS.get(type(network).__name__, ()))


def compile_network(family: Any, plan: Any, log_warning: Callable[[str], None], *, main: bool) -> "RegionalCompile":
    """Compile the repeated blocks of the family's trained diffusers networks (the UNet or transformer, not a
    trained text encoder) in place; returns what reports each compile afterwards."""
    from diffusers import ModelMixin

    networks = [m for m in family.trainable_modules() if isinstance(m, ModelMixin)]
    blocks: dict[str, list[nn.Module]] = {}
    for network in networks:
        names = block_names(network)
        for module in network.modules():
            if type(module).__name__ in names:
                blocks.setdefault(type(module).__name__, []).append(module)
    if not blocks:
        log_warning("train.compile: the trained network ("
                    + (", ".join(type(n).__name__ for n in networks) or "none found") + ") has no repeated blocks "
                    "this trainer knows how to compile; it trains uncompiled (set train.compile=false to silence this)")
    for modules in blocks.values():
        for module in modules:
            module.compile(dynamic=False)
    # Input shapes per bucket: training's, and without gradients the validation loss's full and last micro-batch
    # (trainer.families.components.validation); then the samples', and one spare
    raise_recompile_limit(blocks, shapes=3 * (len(plan.buckets) or 1) + 2)
    compiler = RegionalCompile(networks, blocks, log_warning)
    if main:
        print(f"train.compile: {compiler.what} compiled in place (regional, static shapes); each new input shape "
              "compiles them once", flush=True)
    return compiler


def raise_recompile_limit(blocks: dict[str, list[nn.Module]], *, shapes: int) -> None:
    """Every block class's forward is one function to torch._dynamo, whose cache holds a graph per (block
    configuration, input shape, with or without gradients, inputs that need gradients or not). At worst each block
    is its own configuration: blocks x `shapes` x 2 (a first block's input that needs no gradient) graphs. Past the
    limit dynamo would run the blocks eagerly without a word, so the limit is never below that; a generous limit
    costs nothing, since only the shapes that come compile."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"  # renamed in torch 2.6
    total_name = "accumulated_" + name
    needed = {cls: len(modules) * shapes * 2 for cls, modules in blocks.items()}
    setattr(dynamo, name, max(getattr(dynamo, name), *needed.values(), 0))
    if hasattr(dynamo, total_name):
        setattr(dynamo, total_name, max(getattr(dynamo, total_name), sum(needed.values())))


def _compile_clock() -> tuple[int, float]:
    """(compiles so far, seconds they took) in this process, from torch._dynamo's own records: `_compile.compile_inner`
    times each forward graph (traced and compiled with its joint graph), `backward._backward_impl` each backward graph,
    which is compiled at its first backward pass."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    times = [*metrics.get("_compile.compile_inner", ()), *metrics.get("backward._backward_impl", ())]
    return len(times), float(sum(times))


class RegionalCompile(NoCompile):
    """Reports what compiled since the last optimizer step: the loop asks after every step (`compiled`)."""

    def __init__(self, networks: list[nn.Module], blocks: dict[str, list[nn.Module]],
                 log_warning: Callable[[str], None]):
        self.log_warning = log_warning
        self.blocks = sum(len(m) for m in blocks.values())
        self.what = (f"{self.blocks} blocks ({', '.join(f'{len(m)} {cls}' for cls, m in blocks.items())}) of the "
                     + ", ".join(type(n).__name__ for n in networks))
        self._clock = _compile_clock()
        self._seen: set[str] = set()
        self._new: list[str] = []  # input shapes first seen since the last report, in order
        for network in networks:
            network.register_forward_pre_hook(self._record_input, with_kwargs=True)

    def _record_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """What each network call brings: its first tensor's shape, with gradients (training) or not (samples,
        the validation loss); a new one is what a compile is for."""
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is None:
            return
        shape = "x".join(map(str, tensor.shape)) + ("" if torch.is_grad_enabled() else " without gradients")
        if shape not in self._seen:
            self._seen.add(shape)
            self._new.append(shape)

    def phase(self, phase: str) -> str:
        """While a new input shape may be compiling, the heartbeat says so instead of `step N`: the stall watch
        (trainer.core.stall) counts only training phases, and a cold compile easily outlasts its minute."""
        new = self._new  # the heartbeat's thread reads it; `compiled` replaces the list, never empties it
        return f"compiling for input {new[-1]} at {phase}" if new else phase

    def compiled(self, step: int) -> bool:
        """Whether anything compiled since the last call (the step just ended, or samples and evaluations before
        it); if so, a `warning` event names the input shapes and the seconds compiling took."""
        clock = _compile_clock()
        count, seconds = clock[0] - self._clock[0], clock[1] - self._clock[1]  # graphs, seconds
        self._clock = clock
        new, self._new = self._new, []
        if not count:
            return False
        shapes = ", ".join(f"input {s}" for s in new) or "an input shape seen before"
        self.log_warning(f"train.compile: compiled the {self.what} for {shapes} in {seconds:.1f} s (by step {step}; "
                         "left out of samples/s)")
        return True
