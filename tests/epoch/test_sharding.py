"""Pure sharding: exactly-once partition, determinism per (seed, epoch)."""

import itertools

import pytest

from streamdata.catalog.specs import brace_expand
from streamdata.epoch.sharding import assign, epoch_order
from streamdata.epoch.world import World
from streamdata.errors import SpecError


@pytest.mark.parametrize("n", [0, 1, 7, 64])
@pytest.mark.parametrize("world_size,num_workers", [(1, 1), (2, 3), (3, 4), (5, 1)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_assign_is_an_exact_partition(n, world_size, num_workers, shuffle):
    units = list(range(n))
    got = []
    for rank, worker in itertools.product(range(world_size), range(num_workers)):
        got += assign(units, World(rank, world_size, worker, num_workers), seed=3, epoch=2, shuffle=shuffle)
    assert sorted(got) == units


def test_assign_shares_differ_by_at_most_one_unit():
    units = list(range(10))
    sizes = [len(assign(units, World(r, 2, w, 3))) for r in range(2) for w in range(3)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 10


def test_epoch_order_is_reproducible_and_changes_with_epoch():
    a = epoch_order(100, seed=0, epoch=1, shuffle=True)
    assert list(a) == list(epoch_order(100, seed=0, epoch=1, shuffle=True))
    assert list(a) != list(epoch_order(100, seed=0, epoch=2, shuffle=True))
    assert list(a) != list(epoch_order(100, seed=1, epoch=1, shuffle=True))
    assert list(epoch_order(5, seed=0, epoch=9, shuffle=False)) == [0, 1, 2, 3, 4]


def test_world_rejects_inconsistent_values():
    with pytest.raises(SpecError):
        World(rank=2, world_size=2)


def test_world_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    w = World.current()
    assert (w.rank, w.world_size, w.worker, w.num_workers) == (1, 3, 0, 1)


def test_brace_expand_ranges_lists_and_padding():
    assert brace_expand("a-{00..02}.tar") == ["a-00.tar", "a-01.tar", "a-02.tar"]
    assert brace_expand("{x,y}/{8..10}") == ["x/8", "x/9", "x/10", "y/8", "y/9", "y/10"]
    assert brace_expand("plain") == ["plain"]
    for bad in ["a{3..1}", "a{b}", "a{1..2"]:
        with pytest.raises(SpecError):
            brace_expand(bad)


def test_a_pinned_world_is_this_threads_within_the_block(monkeypatch):
    import threading

    from streamdata.epoch.world import pinned

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    seen = []
    with pinned(World(rank=4, world_size=5)):
        assert World.current() == World(rank=4, world_size=5)
        other = threading.Thread(target=lambda: seen.append(World.current()))
        other.start()
        other.join(10)
    assert seen == [World(rank=1, world_size=3)]  # another thread: the environment's
    assert World.current() == World(rank=1, world_size=3)  # after the block too
