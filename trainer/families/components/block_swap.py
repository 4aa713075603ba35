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

A full fine-tune (`trains=True`) swaps trained weights too, as OneTrainer's and musubi-tuner's offloading do: a
swapped block's fp32 master weights, their gradients and their optimizer state (and EMA) stay in CPU memory. Each
call swaps in its device copy through `_Onloaded`, whose backward hands the gradient to the CPU Parameter (so
accumulation adds up there, and the loop's clipping norm and its one optimizer, which steps CPU tensors on the CPU,
see every gradient: torch's foreach kernels group tensors by device). Their copies are never kept from one pass to
the next (the step changes the weights between them). DDP must leave these Parameters alone (NCCL sends no CPU
tensor): `reduce_gradients` averages their gradients over the processes, once per optimizer step, block by block.
FSDP and DeepSpeed shard the same weights their own way and are refused with block swap
(FamilySpec.block_swap_problem).
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

    def __init__(self, blocks: Sequence[torch.nn.Module], device: torch.device, trains: bool = False):
        self.device = device
        self.trains = trains  # a full fine-tune: the blocks' trained weights are stored (and stepped) on the CPU
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
                if param.requires_grad and not self.trains:  # a LoRA weight: trained on the device, never swapped
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
        if self.trains and not backward and index == 0:  # a new pass: the kept copies predate the last update
            self.ready.clear()
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
            for (owner, attr, param), tensor in zip(stored, copies):
                if param.requires_grad and torch.is_grad_enabled():  # trained: the gradient goes to the CPU store
                    tensor = _Onloaded.apply(param, tensor)
                owner._parameters[attr] = tensor  # functional_call's way of swapping in
            try:
                return forward(*args, **kwargs)
            finally:
                for owner, attr, param in stored:
                    owner._parameters[attr] = param

        return swapped


    def stored_trained(self) -> list[torch.nn.Parameter]:
        """The trained Parameters kept in CPU memory (a full fine-tune's swapped blocks), in block order."""
        return [param for stored in self.stored for _, _, param in stored if param.requires_grad]

    def reduce_gradients(self) -> None:
        """Average the CPU-held gradients over the processes (what DDP does for the others), block by block, so
        that no more than one block's gradients are on the GPU at once for NCCL. Every process calls it after the
        last micro-step's backward; a gradient a process did not produce counts as zeros there."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        for stored in self.stored:
            params = [param for _, _, param in stored if param.requires_grad]
            if not params:
                continue
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            flat = flat.to(self.device)
            dist.all_reduce(flat)
            flat = flat.div_(world).to("cpu")
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()


class _Onloaded(torch.autograd.Function):
    """A stored trained Parameter's device copy as the block sees it: forward, the copy (made ahead, detached);
    backward, the gradient handed to the stored Parameter where it lives (CPU memory), as `param.to(device)`'s
    own backward would do, but with the copy made on the side stream ahead of time."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.home = param.device
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.home), None


def _copied(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """`tensor` on `device`, a copy even on the same device (the CPU), so that the compute never reads the store;
    a quantized subclass (NF4, int8) takes no `copy` argument and is copied only across devices."""
    if type(tensor) is torch.Tensor:
        return tensor.to(device, non_blocking=non_blocking, copy=True)
    return tensor.to(device, non_blocking=non_blocking)


def ignored_by_ddp(network: torch.nn.Module, swap: BlockSwap) -> None:
    """DDP refuses a module whose parameters sit on two device types, and NCCL sends no CPU tensor: DDP is told to
    leave the swapped blocks' stored Parameters alone (the same on the CPU, so that the tests run the GPU's path).
    Frozen ones need no averaging; trained ones (a full fine-tune) are averaged by `swap.reduce_gradients`.
    (trainer.engine.parallel.ddp adds the frozen weights to this list, keeping it.)"""
    from torch.nn.parallel import DistributedDataParallel

    stored = {id(param) for block in swap.stored for _, _, param in block}
    names = [name for name, p in network.named_parameters() if id(p) in stored]
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(network, names)
