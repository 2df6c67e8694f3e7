"""Resuming a pass whose shuffle buffer delivers out of order (RESUME-BUFFER). Pure, no I/O.

A shuffle buffer delivers samples out of reading order, so "``d`` samples delivered" is not the
first ``d`` of the span. But the buffer is a deterministic function of its seed and of the sizes
of the records that enter it, so the pass can be replayed on *positions* instead of samples
(:func:`rewind_point`): which positions the first ``d`` outputs were, and ``m``, the first
position not delivered. The resumed pass then reads from ``m`` only, feeds the shuffle
stand-ins for positions ``[0, m)`` (all delivered: never yielded again), and drops the first
``d`` samples the shuffle puts out (:func:`dropped`): what follows is what the uninterrupted
pass would have yielded, in the same order. Samples re-read: those delivered in ``[m, r)``
(``r``: what had entered the buffer), about one buffer. Costs O(d) work on integers, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from streamdata.epoch.sharding import reader_seed
from streamdata.epoch.world import World

__all__ = ["Rewind", "delivered_mask", "dropped", "placeholder_items", "placeholder_tables", "record_size",
           "rewind_point", "skipped", "undelivered"]


class Rewind(NamedTuple):
    """A pass resumed behind its shuffle buffer: it reads from ``first`` (the first position not
    delivered, ``rewind_point``), feeds the shuffle stand-ins for the positions before it, and
    drops the first ``delivered`` samples the shuffle puts out; ``sizes``: the span's records'
    sizes in samples (Arrow tables' stand-ins are cut as they were, ``placeholder_tables``)."""

    first: int
    delivered: int
    sizes: list[int]


def delivered_mask(shuffle: Callable[[Iterable[Any]], Iterator[Any]], sizes: Sequence[int], delivered: int,
                   tables: bool) -> np.ndarray:
    """Which positions of a span (records of ``sizes`` samples; ``tables``: Arrow tables, else one
    per sample) are among the first ``delivered`` samples ``shuffle`` puts out: one more entry
    than the span has samples, the last False."""
    if tables:
        import pyarrow as pa  # only the Arrow formats' records are tables
    starts = np.concatenate(([0], np.cumsum(np.asarray(sizes, dtype=np.int64))))

    def records() -> Iterator[Any]:
        for i in range(len(sizes)):
            yield pa.table({"p": np.arange(starts[i], starts[i + 1])}) if tables else int(starts[i])

    out: list[np.ndarray] = []
    left = delivered
    if left > 0:
        for item in shuffle(records()):
            if tables:
                take = min(left, item.num_rows)
                out.append(item["p"].to_numpy()[:take])
            else:
                take = 1
                out.append(np.array([item]))
            left -= take
            if not left:
                break
    seen = np.zeros(int(starts[-1]) + 1, dtype=bool)
    if out:
        seen[np.concatenate(out)] = True
    return seen


def rewind_point(shuffle: Callable[[Iterable[Any]], Iterator[Any]], sizes: Sequence[int], delivered: int,
                 tables: bool) -> int:
    """The first position of the span not among the first ``delivered`` samples ``shuffle`` puts out."""
    return int(np.argmin(delivered_mask(shuffle, sizes, delivered, tables)))


def undelivered(shuffled: Callable[[Iterable[Any], list[int]], Iterator[Any]], tables: bool, seed: int,
                epoch: int) -> Callable[[World, Sequence[int], int], list[tuple[int, int]]]:
    """For ``resume``'s RESUME-ELASTIC behind a shuffle buffer: ``runs(world, sizes, d)``, the runs
    ``[a, b)`` of a reader's span (records of ``sizes``) that its first ``d`` samples out of its
    shuffle (``shuffled(records, seed material)``, seeded as the reader's pass was) left out."""
    def runs(world: World, sizes: Sequence[int], d: int) -> list[tuple[int, int]]:
        material = reader_seed(world, seed=seed, epoch=epoch)
        if not tables:
            sizes = [1] * int(sum(sizes))
        mask = delivered_mask(lambda records: shuffled(records, material), sizes, d, tables)[:-1]
        edges = np.flatnonzero(np.diff(np.concatenate(([1], mask.astype(np.int8), [1]))))
        return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    return runs


def dropped(items: Iterable[Any], n: int) -> Iterator[Any]:
    """``items`` without their first ``n`` samples (rows of Arrow tables, else items)."""
    for item in items:
        size = getattr(item, "num_rows", None)
        if n <= 0:
            yield item
        elif size is None:
            n -= 1
        elif size <= n:
            n -= size
        else:
            yield item.slice(n)
            n = 0


def placeholder_items(items: Iterable[Any], m: int) -> Iterator[Any]:
    """``m`` stand-ins (never yielded: the resumed pass drops them), then ``items``."""
    return itertools.chain(itertools.repeat(None, m), items)


def placeholder_tables(tables: Iterable[Any], sizes: Sequence[int], m: int) -> Iterator[Any]:
    """Stand-in tables for positions ``[0, m)`` cut as the original records were (``sizes``),
    then ``tables``; a record cut at ``m`` is joined to the first real table, so the shuffle
    sees the same record boundaries as the original pass did."""
    import pyarrow as pa

    tables = iter(tables)
    first = next(tables, None)
    if first is None:
        return
    filler = first.slice(0, 1)
    at = 0
    for n in sizes:
        if at + n <= m:
            yield filler.take(np.zeros(n, dtype=np.int64))
            at += n
            continue
        if at < m:  # the record holding position m: stand-ins, then its real rows
            first = pa.concat_tables([filler.take(np.zeros(m - at, dtype=np.int64)), first])
        break
    yield first
    yield from tables


def record_size(record: Any) -> int:
    """Samples in a record: rows of an Arrow table, else 1."""
    return getattr(record, "num_rows", 1)


def skipped(records: Iterable[Any], n: int, count: Callable[[int], None]) -> Iterator[Any]:
    """``records`` without their first ``n`` samples (a shard-level split resumed inside a unit);
    ``count(k)`` is told of each ``k`` samples read again to get there."""
    for record in records:
        size = record_size(record)
        if n >= size:
            n -= size
            count(size)
            continue
        if n:
            count(n)
            record, n = record.slice(n), 0
        yield record
