"""The sample shuffle buffer, a stage of every sample-yielding reader (batching: ``incremental.batches``)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import TypeVar

__all__ = ["shuffled"]

T = TypeVar("T")


def shuffled(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """A shuffle buffer of ``size`` items (0 or 1: pass through)."""
    if size <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        i = rng.randrange(size)
        buf[i], item = item, buf[i]
        yield item
    rng.shuffle(buf)
    yield from buf
