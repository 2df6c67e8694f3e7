"""Small generator stages that run inside the reader: the sample shuffle buffer, batching."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["batched", "shuffled"]

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


def batched(items: Iterable[T], batch_size: int, collate: Callable[[list[T]], Any],
            drop_last: bool = False) -> Iterator[Any]:
    """Group items into lists of ``batch_size`` and collate each; the short tail unless drop_last."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == batch_size:
            yield collate(batch)
            batch = []
    if batch and not drop_last:
        yield collate(batch)
