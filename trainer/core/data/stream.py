"""Which samples each (optimizer step, micro-step, rank) trains on: a pure function of the step.

Optimizer step s consumes the global stream positions [s*total, (s+1)*total); position p is item
perm_e[p mod n] of epoch e = p // n, where perm_e is a seeded shuffle. Rank r's micro-step a takes the slice
starting at (a*world + r)*per_device. So:
- every rank sees its own part of the global batch (never the same samples on two GPUs);
- 1 x 4 x accumulation 1 and 2 x 1 x accumulation 2 train on the same 4 samples per step;
- resuming at step s continues with exactly the samples an uninterrupted run would have used,
  even on a different number of processes;
- each position also seeds that sample's noise, timestep and augmentation (see `position_seed`).

With aspect-ratio buckets (`BucketedStream`) the same holds, and in addition every optimizer step's whole global
batch comes from one bucket, so every micro-batch on every rank has one shape.
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


class BucketedStream(BatchStream):
    """Like BatchStream, but optimizer step s's `total` samples all come from one bucket.

    Epoch e: each bucket's items are shuffled (seeded by seed, epoch and bucket) and cut into groups of
    `total`; a bucket's last, short group is filled by wrapping around its own shuffled list (so no image is
    left out; a bucket with fewer items than `total` repeats some of them in its step). The groups of all
    buckets are then shuffled (seeded by seed and epoch): step s of the epoch takes group s. Positions are
    numbered as in BatchStream (step s owns [s*total, (s+1)*total), rank r's micro-step a its slice of that), so
    the samples of a step are the same for any number of processes and any accumulation, and after a resume;
    an epoch is `steps_per_epoch * total` positions.
    """

    def __init__(self, item_buckets: list[int], *, total: int, per_device: int, world_size: int, seed: int):
        super().__init__(len(item_buckets), total=total, per_device=per_device, world_size=world_size, seed=seed)
        members: dict[int, list[int]] = {}
        for index, bucket in enumerate(item_buckets):
            members.setdefault(int(bucket), []).append(index)
        self.buckets = {b: np.array(items) for b, items in sorted(members.items())}
        self.steps_per_epoch = sum(-(-len(items) // total) for items in self.buckets.values())

    def small_buckets(self) -> dict[int, int]:
        """{bucket: items} of the buckets with fewer items than one step's batch (their items repeat in it)."""
        return {b: len(items) for b, items in self.buckets.items() if len(items) < self.total}

    def item(self, position: int) -> tuple[int, int]:
        epoch, offset = divmod(position, self.steps_per_epoch * self.total)
        group, slot = divmod(offset, self.total)
        return epoch, int(self._groups(epoch)[group][slot])

    def bucket_of_step(self, step: int) -> int:
        epoch, group = divmod(step, self.steps_per_epoch)
        return self._bucket_of_group(epoch)[group]

    def epoch_at(self, step: int) -> float:
        return step / self.steps_per_epoch

    def _groups(self, epoch: int) -> np.ndarray:
        return _bucket_groups(self, epoch)[0]

    def _bucket_of_group(self, epoch: int) -> list[int]:
        return _bucket_groups(self, epoch)[1]


@lru_cache(maxsize=8)
def _bucket_groups(stream: BucketedStream, epoch: int) -> tuple[np.ndarray, list[int]]:
    """(groups (steps_per_epoch, total) of item indices, the bucket of each group) of one epoch."""
    total, groups, owners = stream.total, [], []
    for bucket, items in stream.buckets.items():
        order = items[np.random.default_rng([stream.seed, epoch, bucket, 0xB0C7]).permutation(len(items))]
        count = -(-len(items) // total)
        groups.append(order[np.arange(count * total) % len(items)].reshape(count, total))
        owners += [bucket] * count
    stacked = np.concatenate(groups)
    shuffle = np.random.default_rng([stream.seed, epoch, 0x6209]).permutation(len(stacked))
    return stacked[shuffle], [owners[i] for i in shuffle]


def make_stream(num_items: int, *, item_buckets: list[int] | None = None, total: int, per_device: int,
                world_size: int, seed: int) -> BatchStream:
    """The family's stream: bucketed when it reports each item's bucket (`Family.item_buckets`), else plain."""
    if item_buckets is None:
        return BatchStream(num_items, total=total, per_device=per_device, world_size=world_size, seed=seed)
    if len(item_buckets) != num_items:
        raise ValueError(f"{len(item_buckets)} bucket ids for {num_items} items")
    return BucketedStream(list(item_buckets), total=total, per_device=per_device, world_size=world_size, seed=seed)


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0x5EED]).permutation(n)


def position_seed(seed: int, position: int, stream: int = 0) -> int:
    """A 63-bit seed for sample `position`'s randomness (noise, timestep, crop...), independent per stream."""
    return int(np.random.SeedSequence([seed, position, stream]).generate_state(1, dtype=np.uint64)[0] >> 1)
