"""Pure, I/O-free assignment of work units (shards, row groups) to readers.

Invariant (EXACTLY-ONCE): for a given ``(seed, epoch)`` every unit goes to exactly one
reader slot ``rank * num_workers + worker``; the union over all slots is the whole list.
The order is a permutation seeded by ``(seed, epoch)`` alone, so every rank computes the
same permutation without talking to the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from streamdata.epoch.world import World

__all__ = ["assign", "epoch_order", "reader_seed"]

T = TypeVar("T")


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's order of ``n`` units: identity, or a permutation seeded by (seed, epoch)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def assign(units: Sequence[T], world: World, *, seed: int = 0, epoch: int = 0,
           shuffle: bool = False) -> list[T]:
    """The units this reader reads this epoch, in reading order (round-robin over slots)."""
    order = epoch_order(len(units), seed=seed, epoch=epoch, shuffle=shuffle)
    return [units[i] for i in order[world.slot::world.slots]]


def reader_seed(world: World, *, seed: int, epoch: int) -> list[int]:
    """Seed material for this reader's sample-level shuffle buffer."""
    return [seed, epoch, world.rank, world.worker]
