"""`batch.per_device: auto` on GPUs: the largest micro-batch that fits, found by running the real training step.

The plan (a pure function of the config and the hardware) cannot know what fits: it says 1 and leaves a note.
Before training, each worker runs one forward and backward pass of the family's real loss at growing micro-batch
sizes, the divisors of its share of batch.total (so the effective batch stays what the preset says), and stops
at the first that runs out of memory; the ranks agree on the smallest of their largest. The samples a step
trains on depend only on the stream positions (trainer.core.data.stream), never on the micro-batch, so any
answer trains on the same samples, and a resume may probe again.

It runs before DDP wraps the modules (no collective in the backward) and leaves nothing behind: the gradients
are dropped, the global random state is restored, the CUDA cache emptied. Under FSDP or DeepSpeed the modules
are sharded first, so auto stays 1 there (the plan says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from trainer.core.plan import Plan


def candidates(plan: Plan) -> list[int]:
    """The micro-batch sizes worth trying: the divisors of one process's share of the batch, ascending."""
    share = plan.total // plan.world_size
    return [d for d in range(1, share + 1) if share % d == 0]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def largest_that_fits(sizes: list[int], try_step: Callable[[int], None]) -> int:
    """The largest of `sizes` (ascending) for which `try_step(size)` returns without running out of memory,
    stopping at the first that does not; 1 when even the smallest fails (the step itself then reports it)."""
    best = 1
    for size in sizes:
        try:
            try_step(size)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            break
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        best = size
    return best


def probe_per_device(run_loss: Callable[[int], torch.Tensor], params: list[torch.nn.Parameter], plan: Plan,
                     agree: Callable[[int], int]) -> Plan:
    """The plan with batch.per_device auto resolved: `run_loss(size)` computes the loss of a micro-batch of
    `size` samples; `agree(n)` returns the smallest n over the ranks."""
    state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def try_step(size: int) -> None:
        try:
            run_loss(size).backward()
        finally:
            for p in params:
                p.grad = None

    try:
        best = agree(largest_that_fits(candidates(plan), try_step))
    finally:
        torch.set_rng_state(state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
    share = plan.total // plan.world_size
    note = (f"batch.per_device auto: {best} per device fits (probed {', '.join(map(str, candidates(plan)))} "
            f"with the real step); accumulation {share // best}")
    return replace(plan, per_device=best, accumulation=share // best, notes=plan.notes + (note,))
