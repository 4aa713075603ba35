"""DeepSpeed ZeRO stage 1 or 2 (`distributed.sharding: deepspeed`), through accelerate's DeepSpeed plugin.

ZeRO-1 partitions the optimizer state across the processes, ZeRO-2 the gradients too; the weights stay whole on
every process (for sharded weights, ZeRO-3, the trainer has FSDP2: trainer.engine.parallel.fsdp). What changes for the rest
of the trainer, and what does not:

- accelerate prepares the one trained network together with the optimizer; DeepSpeed then owns accumulation
  (its `gradient_accumulation_steps` is the plan's), gradient clipping (`train.max_grad_norm`) and the update,
  which it applies inside the last micro-step's backward. A non-finite gradient norm makes it skip that update
  and clear the gradients, as the loop does without DeepSpeed (trainer.engine.loop counts and reports it the same way).
- precision stays ours: DeepSpeed runs in fp32 (the trained weights stay fp32) under the loop's bf16 autocast.
- the learning-rate schedule stays ours: DeepSpeed steps the torch optimizer it was given, whose param groups
  the scheduler drives.
- checkpoints keep the trainer's format (full tensors, `optimizer.state_dict()` layout): `optimizer_state`
  gathers each parameter's optimizer state from its partitions, `load_optimizer_state` scatters it back, so a
  run can stop under DeepSpeed and resume on another number of processes, with or without DeepSpeed.

The interface is trainer.engine.parallel.Parallelism, so the loop and run_io need not know which one runs.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

NEVER_CLIPS = 1e30  # DeepSpeed computes the gradient norm (and skips non-finite steps) only when it clips


def deepspeed_config(config, plan) -> dict:
    """The DeepSpeed config accelerate hands to `deepspeed.initialize`: batch geometry from the plan."""
    return {
        "train_micro_batch_size_per_gpu": plan.per_device,
        "gradient_accumulation_steps": plan.accumulation,
        "train_batch_size": plan.total,
        "gradient_clipping": config.train.clip_norm() or NEVER_CLIPS,
        "zero_optimization": {"stage": plan.zero_stage},
        "zero_allow_untested_optimizer": True,  # torch's own AdamW / SGD, not DeepSpeed's fused ones
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


def skip_cpu_shm_kernel() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce kernel on CPU processes. Its communication
    backend builds it with g++ on every start that finds no cached build (deepspeed.comm.torch.build_shm_op, into
    ~/.cache/torch_extensions): 40-90 s on 2 cores, the first DeepSpeed run of a machine or a fresh container
    (the suite's zero2 test took 92 s, the three launches of the next test 48 s). Only DeepSpeed's
    `inference_all_reduce` (tensor-parallel inference) uses that kernel; ZeRO training's collectives are
    torch.distributed's (gloo here), so the weights and events are the same without it. An op marked incompatible
    makes build_shm_op return None, DeepSpeed's "not available"; the dict is the one DeepSpeed caches for that
    (deepspeed/ops/__init__.py: "edits to it persist")."""
    try:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except (ImportError, AttributeError, TypeError):
        pass  # another DeepSpeed layout: it builds the kernel as before


class DeepSpeedZero:
    """trainer.engine.parallel.Parallelism for a DeepSpeed-prepared network. `groups`: the trained parameters
    in the order the optimizer was built with (its state_dict indices), kept before DeepSpeed flattens them."""

    shards_weights = False  # the weights are whole on every rank: nothing to gather for samples and outputs
    steps_in_backward = True

    def __init__(self, unwrap_model, zero_stage: int):
        self._unwrap_model = unwrap_model
        self.zero_stage = zero_stage
        self.groups: list[list[torch.nn.Parameter]] = []

    def shard(self, family) -> None:
        pass

    def wrap(self, family, accelerator, optimizer) -> None:
        """The network and the optimizer are prepared together; `optimizer` stays the torch one."""
        [network] = family.trainable_modules()  # the plan refuses a second trained module
        self.groups = [list(g["params"]) for g in optimizer.param_groups]
        engine, _ = accelerator.prepare(network, optimizer)
        if accelerator.distributed_type.value != "DEEPSPEED":  # accelerate may drop the plugin without a word
            raise RuntimeError(f"distributed.sharding=deepspeed, but accelerate set up "
                               f"{accelerator.distributed_type.value}")
        if accelerator.is_main_process:
            print(f"deepspeed: ZeRO stage {self.zero_stage} across {accelerator.num_processes} processes", flush=True)
        family.set_prepared([engine])

    @contextmanager
    def gathered(self, device=None, dtype=None):
        yield

    def unwrap(self, module):
        return self._unwrap_model(module)

    def trained_parameters(self, optimizer) -> list[torch.Tensor]:
        """The network's own trained parameters, whole on every rank (the optimizer holds DeepSpeed's flat
        partitions instead)."""
        return [p for group in self.groups for p in group]

    # ---- optimizer state in checkpoints -------------------------------------------------------------------
    def optimizer_state(self, optimizer) -> dict:
        """Every rank calls this (each parameter's state is gathered from its partitions); the torch optimizer's
        `state_dict()` form of an unpartitioned run. `optimizer`: the torch optimizer DeepSpeed steps."""
        from deepspeed.utils import safe_get_full_optimizer_state

        keys, scalars = _state_keys(optimizer)
        state, index = {}, 0
        for group_params, scalar in zip(self.groups, scalars):
            for param in group_params:
                full = {key: safe_get_full_optimizer_state(param, key).detach().cpu() for key in keys}
                # each parameter its own copy of the scalars: AdamW increments its `step` tensor in place
                own = {k: v.clone() if torch.is_tensor(v) else v for k, v in scalar.items()}
                state[index] = {**own, **full} if full else {}
                index += 1
        return {"state": {i: s for i, s in state.items() if s}, "param_groups": self._param_groups(optimizer)}

    def load_optimizer_state(self, optimizer, saved: dict) -> None:
        """Every rank calls this after accelerate prepared the optimizer: each parameter's saved state goes into
        its partitions. DeepSpeed's partitions get their optimizer state at the first step, so it is first
        materialized by a step at learning rate 0 with zero gradients (which changes no weight), then replaced."""
        from deepspeed.utils import (
            lazy_init_hp_params_optimizer_state,
            safe_set_full_optimizer_state,
        )

        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        if not saved["state"]:
            return
        if _materialize(optimizer):
            # each parameter's view into its partition's state, linked as DeepSpeed links it after its first step
            for group_params, partitions in zip(self.groups, optimizer.param_groups):
                [partition] = partitions["params"]
                lazy_init_hp_params_optimizer_state(group_params, partition, optimizer.state)
        index = 0
        for group_params, partitions in zip(self.groups, optimizer.param_groups):
            for param in group_params:
                for key, value in saved["state"].get(index, {}).items():
                    if torch.is_tensor(value) and value.shape == param.shape:
                        safe_set_full_optimizer_state(param, value.to(param.device, torch.float32), key)
                    else:  # per-group scalars (AdamW's step): the same for every partition of the group
                        for partition in partitions["params"]:
                            optimizer.state[partition][key] = _like(optimizer.state[partition].get(key), value)
                index += 1

    def _param_groups(self, optimizer) -> list[dict]:
        out, start = [], 0
        for group_params, group in zip(self.groups, optimizer.param_groups):
            out.append({**{k: v for k, v in group.items() if k != "params"},
                        "params": list(range(start, start + len(group_params)))})
            start += len(group_params)
        return out


def _state_keys(optimizer) -> tuple[list[str], list[dict]]:
    """(the per-element state keys, e.g. exp_avg / exp_avg_sq / momentum_buffer; per group, its scalar state,
    e.g. AdamW's step). Empty before the first step."""
    keys: list[str] = []
    scalars = []
    for group in optimizer.param_groups:
        partition = group["params"][0]
        scalar = {}
        for key, value in optimizer.state.get(partition, {}).items():
            if torch.is_tensor(value) and value.shape == partition.shape:
                if key not in keys:
                    keys.append(key)
            else:
                scalar[key] = value.detach().clone().cpu() if torch.is_tensor(value) else value
        scalars.append(scalar)
    return keys, scalars


def _materialize(optimizer) -> bool:
    """Create the optimizer's state by a step that changes no weight; False if it already had one."""
    if all(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        return False
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
        for p in group["params"]:
            p.grad = None
    return True


def _like(current, value):
    if torch.is_tensor(current):
        return torch.as_tensor(value, dtype=current.dtype, device=current.device).clone()
    return value
