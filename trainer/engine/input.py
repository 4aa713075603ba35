"""The input pipeline: each micro-batch's samples read, decoded and augmented ahead of the step that trains on them.

A micro-batch is a function of (step, micro-step, rank) (trainer.core.data.stream), and every random draw of a
sample is seeded by its stream position, so the micro-batches can be made anywhere, in any order, by any process,
and come out the same. With `data.workers` > 0 a torch DataLoader makes them in worker processes, prefetching
`PREFETCH` micro-batches per worker and pinning them on CUDA; with 0 the training thread makes each one when the
step asks for it (the family's `loss(samples)` as before). Either way the step receives the same tensors: tested
in tests/test_input_pipeline.py, also across a stop and resume.

What a worker does is the family's `fetch(samples)` (trainer.families.protocol.Fetches): the CPU half of its
loss (files, decoding, augmentation, cached tensors), never the models. A family without `fetch` always loads on
the training thread. The time the step waits for its micro-batch is measured by the loop either way and
reported in `progress` events (trainer.engine.telemetry).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from trainer.families.protocol import Fetches, Sample

PREFETCH = 2
"""Micro-batches each worker keeps ready (DataLoader's prefetch_factor): two cover one step's jitter."""


@dataclass
class MicroBatch:
    step: int
    micro: int
    samples: list[Sample]
    fetched: Any  # the family's fetch(samples), or None: the family loads in `loss(samples)`; from a worker, its
    # tensors stand in `packed` and `fetched` holds their places (see `pack`)
    packed: torch.Tensor | None = None

    def pin_memory(self) -> "MicroBatch":
        """Called by the DataLoader's pinning thread (pin_memory=True on CUDA): page-locked tensors copy to the
        GPU without blocking the step (`fetched_on`)."""
        if self.packed is not None:
            return replace(self, packed=self.packed.pin_memory())
        return replace(self, fetched=_map_tensors(self.fetched, lambda t: t.pin_memory()))

    def fetched_on(self, device: torch.device) -> Any:
        """The fetched tensors on `device`: a worker's in one non-blocking copy of its buffer, then viewed."""
        if self.packed is None:
            return to_device(self.fetched, device)
        return unpack(self.fetched, self.packed.to(device, non_blocking=True))


class _Positions(torch.utils.data.Dataset):
    """Micro-batch k of the run from `start`: its samples, fetched. Indexable, so any worker makes any k."""

    def __init__(self, stream, family, rank: int, start: int, steps: int, accumulation: int):
        self.stream, self.family, self.rank = stream, family, rank
        self.start, self.accumulation = start, accumulation
        self.count = (steps - start) * accumulation

    def __len__(self) -> int:
        return self.count

    def samples(self, k: int) -> tuple[int, int, list[Sample]]:
        step, micro = divmod(k, self.accumulation)
        step += self.start
        positions = self.stream.positions(step, micro, self.rank)
        return step, micro, [Sample(pos, *self.stream.item(pos)) for pos in positions]

    def __getitem__(self, k: int) -> MicroBatch:
        step, micro, samples = self.samples(k)
        fetched = self.family.fetch(samples) if isinstance(self.family, Fetches) else None
        if torch.utils.data.get_worker_info() is not None:  # in a worker: one buffer crosses to the trainer
            places, packed = pack(fetched)
            return MicroBatch(step, micro, samples, places, packed)
        return MicroBatch(step, micro, samples, fetched)


def _one_thread(_: int) -> None:
    # A worker decodes images; torch's intra-op threads in N workers x M ranks would oversubscribe the cores the
    # training processes need.
    torch.set_num_threads(1)


class InputPipeline:
    """`for batch in pipeline.from_step(s)`: the micro-batches of steps s.. in order."""

    def __init__(self, stream, family, *, rank: int, steps: int, accumulation: int, workers: int, pin: bool):
        self.stream, self.family, self.rank = stream, family, rank
        self.steps, self.accumulation = steps, accumulation
        # Without `fetch` a worker could only hand back sample indices: no work to move, so no processes.
        self.workers = workers if isinstance(family, Fetches) else 0
        self.pin = pin

    def from_step(self, start: int) -> Iterator[MicroBatch]:
        dataset = _Positions(self.stream, self.family, self.rank, start, self.steps, self.accumulation)
        if self.workers == 0:
            source: Any = (dataset[k] for k in range(len(dataset)))
        else:
            # fork: the workers inherit the family (its scan and caches) instead of unpickling it; they only run
            # `fetch`, which touches no device. batch_size=None: each item is already a whole micro-batch.
            source = torch.utils.data.DataLoader(
                dataset, batch_size=None, shuffle=False, num_workers=self.workers, prefetch_factor=PREFETCH,
                pin_memory=self.pin, worker_init_fn=_one_thread, multiprocessing_context="fork",
                persistent_workers=False)
        iterator = iter(source)
        try:
            yield from iterator
        finally:
            # A stop or failure ends the loop early: end the workers now, not when the iterator is collected.
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


def to_device(value: Any, device: torch.device) -> Any:
    """`value`'s tensors on `device` (non-blocking from pinned memory), through lists, tuples and dicts."""
    return _map_tensors(value, lambda t: t.to(device, non_blocking=True))


def _map_tensors(value: Any, fn) -> Any:
    return _map_leaves(value, torch.Tensor, fn)


def _map_leaves(value: Any, leaf: type, fn) -> Any:
    """`value` with fn applied to each `leaf`, through lists, tuples and dicts."""
    if isinstance(value, leaf):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_leaves(v, leaf, fn) for v in value)
    return value


# A worker's micro-batch crosses to the training process as one flat byte buffer rather than tensor by tensor:
# the DataLoader sends each tensor as its own shared-memory segment, which cost the receiving training process
# ~0.2 ms of CPU per tensor (40 tensors: 9.0 ms per micro-batch; packed: 0.5 ms; measured with two workers on this
# 2-core CPU), and on a GPU the buffer is pinned and copied in one transfer instead of one per tensor.
_ALIGN = 64  # bytes: every tensor's offset, so that a byte slice can be viewed as any dtype


@dataclass(frozen=True)
class _Place:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def pack(value: Any) -> tuple[Any, torch.Tensor]:
    """`value` with each tensor replaced by its place in the returned uint8 buffer (byte copies: exact)."""
    tensors: list[torch.Tensor] = []
    offsets: list[int] = []
    total = 0

    def place(t: torch.Tensor) -> _Place:
        nonlocal total
        tensors.append(t)
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        return _Place(offsets[-1], t.dtype, tuple(t.shape))

    places = _map_tensors(value, place)
    buffer = torch.empty(total, dtype=torch.uint8)
    for t, offset in zip(tensors, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + raw.numel()] = raw
    return places, buffer


def unpack(places: Any, buffer: torch.Tensor) -> Any:
    """`pack`'s inverse: the tensors as views of `buffer` (on whatever device it is)."""
    def view(p: _Place) -> torch.Tensor:
        nbytes = torch.Size(p.shape).numel() * p.dtype.itemsize
        return buffer[p.offset:p.offset + nbytes].view(p.dtype).view(p.shape)

    return _map_leaves(places, _Place, view)
