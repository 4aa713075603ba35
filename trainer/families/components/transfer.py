"""Host-to-device copies that do not stop the host: the step's one host sync is its loss all-reduce.

A `.to(device)` of a CPU tensor (and `torch.tensor(values, device=...)`) waits for the copy, and so for every
kernel queued before it: the CPU can no longer run ahead of the GPU, which then idles while the next kernels are
launched (what made SDXL's step "launch-bound" in bench/README.md). With `non_blocking=True` the copy is queued in
order on the stream: from pinned memory (the input pipeline's) it is a DMA, from pageable memory CUDA stages the
bytes at once and returns (no device synchronisation either way), so the CPU tensor may be dropped right after.
On the CPU it is the plain copy. Only for host -> device: a device -> host copy must be waited for before its
values are read. tests/test_gpu_syncs.py counts the syncs of a step on a GPU.
"""

from __future__ import annotations

import torch


def on_device(tensor: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    return tensor.to(device, dtype=dtype, non_blocking=True)


def tensor_on(values, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` without the host waiting for the copy."""
    return on_device(torch.tensor(values, dtype=dtype), device)
