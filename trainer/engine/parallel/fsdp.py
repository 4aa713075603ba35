"""FSDP2 for full fine-tunes that do not fit on one GPU: weights, gradients and optimizer state sharded across
the processes (ZeRO-3), through PyTorch's own `fully_shard`.

Why torch's FSDP2 directly and not accelerate's FSDP plugin: accelerate enables FSDP only on GPU launches
(MULTI_GPU...), never on CPU processes, so the sharded path could not be tested where the tests run; torch's
`fully_shard` is the same FSDP2 accelerate calls, and it runs on CPU with gloo. One code path, tested.

What sharding changes, and how the rest of the trainer stays unaware of it:
- the trainable modules are sharded block by block (the classes a model lists in `_no_split_modules`, as
  accelerate's transformer auto-wrap does) before the optimizer is built, so it holds the sharded parameters;
- DDP is not used for them (FSDP reduce-scatters the gradients itself; accumulation still divides the loss);
- whatever needs whole weights (samples, checkpoints, outputs) runs inside `gathered()`, which every rank
  enters: the full weights are gathered tensor by tensor to rank 0's CPU memory, and rank 0 works on a plain
  copy of each module built from them (`unwrap`; moved to the GPU, in the sampling dtype, for samples);
- checkpoints hold full tensors in the same format as unsharded runs (`optimizer_state` / `load_optimizer_state`
  convert), so a run can stop under FSDP and resume without it, or the other way round.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


class FSDP:
    """FSDP2 for the trainable modules (trainer.engine.parallel.Parallelism)."""

    shards_weights = True
    steps_in_backward = False  # the loop clips and steps the optimizer itself (DeepSpeed does it in backward)

    def __init__(self, unwrap_model):
        self._unwrap_model = unwrap_model  # the accelerator's, for modules that are not sharded
        self._modules: list[nn.Module] = []
        self._plain: dict[int, nn.Module] | None = None  # id(sharded module) -> plain copy, inside gathered()

    # ---- setup --------------------------------------------------------------------------------------------
    def shard(self, family) -> None:
        """Shard each trainable module in place (its blocks, then the module itself), before the optimizer takes
        the parameters, and hand them to the family for the loop."""
        family.set_prepared(self._shard(family.trainable_modules()))

    def wrap(self, family, accelerator, optimizer) -> None:
        pass  # FSDP reduce-scatters the gradients itself: no DDP wrapper

    def _shard(self, modules: list[nn.Module]) -> list[nn.Module]:
        _, fully_shard = _fsdp()
        for module in modules:
            units = set(getattr(module, "_no_split_modules", None) or ())
            # innermost first: a unit may sit inside another (a UNet's CrossAttnUpBlock2D holds ResnetBlock2Ds),
            # and fully_shard refuses a module inside one already sharded
            for sub in reversed(list(module.modules())):
                if sub is not module and type(sub).__name__ in units:
                    fully_shard(sub)
            fully_shard(module)
            module.no_sync = _no_sync_of(module)  # what accelerate's accumulate() looks for, as on DDP
            self._modules.append(module)
        return modules

    # ---- whole weights ------------------------------------------------------------------------------------
    @contextmanager
    def gathered(self, device=None, dtype=None):
        """Every rank enters: the sharded weights are gathered tensor by tensor into full CPU tensors on rank 0
        (so no GPU ever holds the whole fp32 model on top of its shards), where `unwrap` gives plain modules
        built from them: on the CPU for writing files, or moved to `device` in `dtype` for drawing samples."""
        if self._plain is not None:
            yield
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        plain = {}
        for module in self._modules:
            full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if full:  # rank 0
                copy = _plain_copy(module, full)
                plain[id(module)] = copy.to(device, dtype) if device is not None else copy
            del full
        self._plain = plain
        try:
            yield
        finally:
            self._plain = None
            del plain
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.empty_cache()

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The module to sample with, save or checkpoint: inside `gathered` on rank 0, a plain copy with the full
        weights, free of FSDP hooks."""
        if not any(module is m for m in self._modules):
            return self._unwrap_model(module)
        if self._plain is None or id(module) not in self._plain:
            raise RuntimeError("a sharded module's full weights exist only on rank 0 inside FSDP.gathered()")
        return self._plain[id(module)]

    def trained_parameters(self, optimizer) -> list[torch.Tensor]:
        """The parameters the optimizer updates (under FSDP: this rank's shards of them)."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    # ---- optimizer state in checkpoints -------------------------------------------------------------------
    def optimizer_state(self, optimizer) -> dict | None:
        """Every rank calls this; the full optimizer state in `optimizer.state_dict()` form (rank 0)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        container = nn.ModuleList(self._modules)
        # torch types the state as a union per key; it is `optimizer.state_dict()`'s layout, keyed by names.
        full: dict[str, Any] = get_optimizer_state_dict(
            container, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if "param_groups" not in full:
            return None  # cpu_offload: only rank 0 receives the full state (and writes it)
        names = _names_in_optimizer_order(container, optimizer)
        index = {name: i for i, name in enumerate(names)}
        return {
            "state": {index[name]: value for name, value in full.get("state", {}).items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]],
        }

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        container = nn.ModuleList(self._modules)
        names = _names_in_optimizer_order(container, optimizer)
        by_name: dict[str, Any] = {
            "state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
        set_optimizer_state_dict(container, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _no_sync_of(module):
    """A DDP-style `no_sync()` for an FSDP2 module: gradients of the micro-steps before the last one of an
    accumulation stay local (summed unsharded) and are reduce-scattered once, with the last."""

    @contextmanager
    def no_sync():
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    return no_sync


def _names_in_optimizer_order(container: nn.Module, optimizer) -> list[str]:
    """Each optimizer parameter's name in `container`, in the optimizer's own order (its state_dict indices)."""
    name_of = {id(p): name for name, p in container.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _plain_copy(module: nn.Module, state: dict) -> nn.Module:
    """A module of the sharded one's original class holding `state` (its full state dict, on the CPU)."""
    FSDPModule, _ = _fsdp()
    cls = next(c for c in type(module).__mro__ if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))
    with torch.device("meta"):
        # from_config: diffusers' models (ConfigMixin), which the hasattr finds on the instance, not on `cls`.
        plain = (cls.from_config(module.config)  # type: ignore[attr-defined]
                 if hasattr(module, "from_config") else cls(module.config))
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    buffers = {name for name, _ in plain.named_buffers(remove_duplicate=False)}
    if unexpected or set(missing) - buffers:
        raise RuntimeError(f"plain copy of {cls.__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for sub_name, sub in module.named_modules():  # buffers are not sharded; non-persistent ones are not in `state`
        target = plain.get_submodule(sub_name)
        for name, buf in sub._buffers.items():
            current = target._buffers.get(name)
            if buf is not None and (current is None or current.is_meta):
                target._buffers[name] = buf.detach().cpu()
    return plain.eval()
