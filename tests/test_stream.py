"""The batch stream decides which samples every rank trains on at every step: the heart of 1-vs-N equivalence."""

import pytest

from trainer.core.data.stream import BatchStream, position_seed


def _global_batch(stream, step):
    positions = []
    for micro in range(stream.accumulation):
        for rank in range(stream.world_size):
            positions += stream.positions(step, micro, rank)
    return positions


@pytest.mark.parametrize("per_device, world", [(4, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
def test_every_layout_trains_on_the_same_samples_per_step(per_device, world):
    reference = BatchStream(10, total=4, per_device=4, world_size=1, seed=3)
    stream = BatchStream(10, total=4, per_device=per_device, world_size=world, seed=3)
    for step in range(7):
        mine = _global_batch(stream, step)
        assert sorted(mine) == sorted(_global_batch(reference, step)) == list(range(step * 4, step * 4 + 4))
        assert len(set(mine)) == 4  # no sample twice, i.e. no two ranks on the same data


def test_ranks_see_different_samples_and_epochs_are_permutations():
    stream = BatchStream(8, total=4, per_device=1, world_size=2, seed=0)
    assert set(stream.positions(0, 0, 0)).isdisjoint(stream.positions(0, 0, 1))
    epoch0 = [stream.item(p) for p in range(8)]
    epoch1 = [stream.item(p) for p in range(8, 16)]
    assert sorted(i for _, i in epoch0) == sorted(i for _, i in epoch1) == list(range(8))
    assert {e for e, _ in epoch0} == {0} and {e for e, _ in epoch1} == {1}
    assert [i for _, i in epoch0] != [i for _, i in epoch1]  # reshuffled each epoch
    assert stream.epoch_at(4) == 2.0


def test_order_and_seeds_depend_only_on_seed_and_position():
    a = BatchStream(50, total=4, per_device=2, world_size=1, seed=1)
    b = BatchStream(50, total=4, per_device=1, world_size=2, seed=1)
    assert [a.item(p) for p in range(120)] == [b.item(p) for p in range(120)]
    assert [a.item(p) for p in range(50)] != [BatchStream(50, total=4, per_device=4, world_size=1, seed=2).item(p)
                                              for p in range(50)]
    assert position_seed(1, 5) == position_seed(1, 5) != position_seed(1, 6) != position_seed(1, 5, stream=1)


def test_impossible_layouts_are_refused():
    with pytest.raises(ValueError):
        BatchStream(10, total=6, per_device=4, world_size=1, seed=0)
    with pytest.raises(ValueError):
        BatchStream(0, total=4, per_device=4, world_size=1, seed=0)
