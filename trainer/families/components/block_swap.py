"""`model.block_swap`: the frozen weights of the denoiser's last N repeated blocks live in CPU memory (pinned, on
CUDA) and are copied to the compute device for each call of the block, the next block's copy running ahead on a side
stream while the current block computes. Why our own and not diffusers' group offloading or FSDP2's CPU offload:
bench/block_swap.md.

Needs gradient checkpointing (refused without it, trainer.core.config.validate): under it, autograd keeps a block's
weights only between its recompute and its backward, so the copies made for the recompute are what the backward
uses, and a block's device copy is freed when its backward is done. Without checkpointing every block's weights
would be saved for the backward and nothing would leave the device. So there is one mechanism for the forward, the
recompute and the backward, and no hook on the backward.

The copies are plain tensors swapped into the block's modules for the duration of its call (as
`torch.func.functional_call` does); the block's registered Parameters stay the CPU store, so the state dict, the
weights' dtype and every exporter see the model as it was loaded. Trained parameters (LoRA) of a swapped block stay
on the device and are never copied. On the CPU the same code runs: the store and the compute device are both CPU
memory and every call still copies, so the tests exercise the path a GPU takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch

# (owner module, attribute name, stored Parameter) for each frozen tensor of one block
Stored = list[tuple[torch.nn.Module, str, torch.nn.Parameter]]


def last_blocks(network: torch.nn.Module, block_lists: Sequence[str], count: int) -> list[torch.nn.Module]:
    """The last `count` blocks of the ModuleLists named by `block_lists` (in the network's forward order): the
    first blocks stay resident, so a step starts without waiting for a copy."""
    blocks = [block for name in block_lists for block in getattr(network, name, None) or ()]
    return blocks[len(blocks) - min(count, len(blocks)):] if count > 0 else []


class BlockSwap:
    """Installed on a network after its frozen weights are placed (swapped blocks left in CPU memory) and its LoRA is
    added; `calls` counts swapped blocks' calls and `copies` their copies (fewer: a prefetched or kept copy is used)."""

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.stored: list[Stored] = []
        self.ready: dict[int, tuple[list[torch.Tensor], Any]] = {}  # block -> (device copies, copy-done event)
        self.calls = self.copies = 0
        for index, block in enumerate(blocks):
            self.stored.append(self._store(block))
            block.forward = self._swapped_forward(index, block.forward)

    def _store(self, block: torch.nn.Module) -> Stored:
        stored: Stored = []
        for owner in block.modules():
            for attr, param in list(owner._parameters.items()):
                if param is None:
                    continue
                if param.requires_grad:  # a LoRA weight: trained on the device, never swapped
                    param.data = param.data.to(self.device)
                    continue
                if self.cuda and type(param.data) is torch.Tensor:  # a quantized subclass (NF4) is kept as is
                    param.data = param.data.to("cpu").pin_memory()
                stored.append((owner, attr, param))
            for attr, buffer in list(owner._buffers.items()):
                if buffer is not None:  # small (rotary tables, scales): resident
                    owner._buffers[attr] = buffer.to(self.device)
        return stored

    def _copy(self, index: int) -> list[torch.Tensor]:
        self.copies += 1
        return [_copied(param.detach(), self.device, self.cuda) for _, _, param in self.stored[index]]

    def _prefetch(self, index: int) -> None:
        if index in self.ready or not 0 <= index < len(self.stored):
            return
        if self.stream is None:
            self.ready[index] = (self._copy(index), None)
            return
        with torch.cuda.stream(self.stream):
            copies = self._copy(index)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ready[index] = (copies, event)

    def _onload(self, index: int, backward: bool) -> list[torch.Tensor]:
        """Block `index`'s device copies (waiting for its prefetch), and the next block's copy started: the one after
        it in the forward, the one before it in the backward's recompute. Copies of other blocks are dropped (the
        autograd graph keeps a recomputed block's copies until its backward is done)."""
        self.calls += 1
        copies, event = self.ready.pop(index, None) or (self._copy(index), None)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in copies:  # made on the side stream, freed only after the compute stream has used them
                if type(tensor) is torch.Tensor:
                    tensor.record_stream(current)
        following = index - 1 if backward else index + 1
        self.ready = {k: v for k, v in self.ready.items() if k == following}
        self._prefetch(following)
        self.ready[index] = (copies, None)  # kept: the backward starts with the forward's last block
        return copies

    def _swapped_forward(self, index: int, forward: Callable) -> Callable:
        stored = self.stored[index]

        def swapped(*args, **kwargs):
            # A block's recompute under checkpointing runs inside the backward's graph task
            copies = self._onload(index, backward=torch._C._current_graph_task_id() != -1)
            for (owner, attr, _), tensor in zip(stored, copies):
                owner._parameters[attr] = tensor  # functional_call's way of swapping in
            try:
                return forward(*args, **kwargs)
            finally:
                for owner, attr, param in stored:
                    owner._parameters[attr] = param

        return swapped


def _copied(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """`tensor` on `device`, a copy even on the same device (the CPU), so that the compute never reads the store;
    a quantized subclass (NF4, int8) takes no `copy` argument and is copied only across devices."""
    if type(tensor) is torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking, copy=True)
    return tensor.to(device, non_blocking=non_blocking)


def ignored_by_ddp(network: torch.nn.Module) -> None:
    """DDP refuses a module whose parameters sit on two device types (the swapped frozen weights in CPU memory):
    frozen weights need no gradient averaging, so DDP is told to leave the CPU-resident ones alone."""
    names = [name for name, p in network.named_parameters() if not p.requires_grad and p.device.type == "cpu"]
    if names and any(p.device.type != "cpu" for p in network.parameters()):
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(network, names)
