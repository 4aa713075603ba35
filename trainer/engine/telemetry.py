"""Per-rank figures of each step, as MLOps trackers keep them, carried by the step's one all-reduce.

Every rank measures its own step (`RankClock`): wall time, time waiting for its input, time in the forward pass,
time in the step's final all-reduce, process CPU time, resident memory and, on GPUs, peak device memory and
utilisation. Its figures travel in its own slots of the loss all-reduce (trainer.engine.loop._reduce_step), so
every rank learns every rank's figures without a collective or host sync of their own. On GPUs the forward
time comes from CUDA events that are read only after that all-reduce has synchronised, so the figures a step
carries are those of the step before it (`progress` events say which: `ranks_step`).

The fields, their summary and when a rank counts as lagging are trainer.core.telemetry (torch-free: the UI reads
them too).
"""

from __future__ import annotations

import os
import resource
import time

import torch

from trainer.core.telemetry import WIDTH

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20 if hasattr(os, "sysconf") else 4096 / 2**20


class RankClock:
    """This rank's figures of its current step; `figures()` gives those of the last finished one."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.last: list[float] | None = None
        self._nvml = _nvml_handle(device) if self.cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin_step(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        self.data_s = self.forward_s = self.sync_s = 0.0
        self._events = []

    def waited(self, seconds: float) -> None:
        self.data_s += seconds

    def forward(self):
        """Context manager around the forward pass."""
        return _Timed(self)

    def synced(self, seconds: float) -> None:
        self.sync_s += seconds

    def end_step(self) -> None:
        """After the step's all-reduce: its CUDA events are complete, so reading them does not wait."""
        forward_s = self.forward_s
        if self._events:
            forward_s = sum(start.elapsed_time(end) for start, end in self._events) / 1000
        rss = _rss_mb()
        peak_rss = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # KiB on Linux
        mem = torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else -1.0
        self.last = [time.perf_counter() - self._wall, self.data_s, forward_s, self.sync_s,
                     time.process_time() - self._cpu, rss, peak_rss, mem, self._utilisation()]

    def figures(self) -> list[float]:
        """The last finished step's figures (zeros before the first), for this rank's slots of the all-reduce."""
        return list(self.last) if self.last is not None else [0.0] * WIDTH

    def _utilisation(self) -> float:
        if self._nvml is None:
            return -1.0
        try:
            import pynvml  # type: ignore[import-not-found]

            return float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu)
        except Exception:  # noqa: BLE001 -- a telemetry read never fails a run
            return -1.0


class _Timed:
    def __init__(self, clock: RankClock):
        self.clock = clock

    def __enter__(self):
        if self.clock.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.clock._events.append((start, end))
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.clock.cuda:
            self.clock._events[-1][1].record()
        self.clock.forward_s += time.perf_counter() - self.began


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_MB
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _nvml_handle(device: torch.device):
    """NVML's handle of this rank's GPU, or None without pynvml (`pip install nvidia-ml-py`)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:  # NVML numbers GPUs physically; torch numbers the visible ones
            index = int(visible.split(",")[index])
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception:  # noqa: BLE001 -- optional: utilisation is left out
        return None
