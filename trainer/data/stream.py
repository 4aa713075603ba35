"""Which samples each (optimizer step, micro-step, rank) trains on: a pure function of the step.

Optimizer step s consumes the global stream positions [s*total, (s+1)*total); position p is item
perm_e[p mod n] of epoch e = p // n, where perm_e is a seeded shuffle. Rank r's micro-step a takes the slice
starting at (a*world + r)*per_device. So:
- every rank sees its own part of the global batch (never the same samples on two GPUs);
- 1 x 4 x accumulation 1 and 2 x 1 x accumulation 2 train on the same 4 samples per step;
- resuming at step s continues with exactly the samples an uninterrupted run would have used,
  even on a different number of processes;
- each position also seeds that sample's noise, timestep and augmentation (see `position_seed`).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


class BatchStream:
    def __init__(self, num_items: int, *, total: int, per_device: int, world_size: int, seed: int):
        if num_items < 1:
            raise ValueError("the dataset is empty")
        if per_device * world_size > total or total % (per_device * world_size):
            raise ValueError(f"batch {total} is not per_device {per_device} x world {world_size} x accumulation")
        self.num_items = num_items
        self.total = total
        self.per_device = per_device
        self.world_size = world_size
        self.seed = seed

    @property
    def accumulation(self) -> int:
        return self.total // (self.per_device * self.world_size)

    def positions(self, step: int, micro: int, rank: int) -> list[int]:
        start = step * self.total + (micro * self.world_size + rank) * self.per_device
        return list(range(start, start + self.per_device))

    def item(self, position: int) -> tuple[int, int]:
        """(epoch, dataset index) of a stream position."""
        epoch, offset = divmod(position, self.num_items)
        return epoch, int(_permutation(self.num_items, self.seed, epoch)[offset])

    def epoch_at(self, step: int) -> float:
        return step * self.total / self.num_items


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n)


def position_seed(seed: int, position: int, stream: int = 0) -> int:
    """A 63-bit seed for sample `position`'s randomness (noise, timestep, crop...), independent per stream."""
    return int(np.random.SeedSequence([seed, position, stream]).generate_state(1, dtype=np.uint64)[0] >> 1)
