"""Exact epochs: an epoch's samples divided into contiguous spans, one per reader. Pure, no I/O.

With every unit's sample count known (a tar index, Parquet footers), an epoch is the sequence
of all samples, units in the epoch's seeded order (``sharding.epoch_order``). It is cut into
``world.slots`` contiguous spans, in slot order (``rank * num_workers + worker``); a span may
start and end inside a unit. A reader computes only its own span, in O(units + slots).

Invariant (EQUAL-STEPS): every rank yields the same number of batches, so a DDP job never
waits at the end of an epoch for a rank that has run out.

- Default: every sample exactly once per epoch. Spans are equal within one sample; the extra
  samples (``N % slots``) go to worker 0 of each rank in turn, then worker 1..., so ranks'
  counts differ by at most one extra. Where an extra gives a rank one batch more than another,
  one reader of each other rank splits its last full batch in two (``tail``): its last two
  batches are short instead of none. Only where that is impossible (``batch_size=1``, or fewer
  samples than readers) does that reader repeat one sample (``pad``), counted by the caller.
- ``drop_last=True``: every reader gets the same whole number of full batches; the fewer than
  ``slots * batch_size`` samples left over are a contiguous run at a seeded offset, so a
  different set is left out each epoch.
- ``batch_size=None``: spans equal within one sample; steps are the DataLoader's business.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from streamdata.epoch.sharding import epoch_order
from streamdata.epoch.world import World

__all__ = ["SampleSlice", "Segment", "Skip", "Span", "Steps", "batch_sizes", "reader_span", "reader_steps",
           "segments_of", "slot_sizes"]


@dataclass(frozen=True)
class Segment:
    """Samples ``[start, stop)`` of unit ``unit`` (an index into the dataset's units)."""

    unit: int
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start


class SampleSlice(NamedTuple):
    """What a reader reads of one unit of ``unit_samples`` samples: samples ``[start, stop)`` (an
    exact epoch's segment; EQUAL-STEPS: a span may start and end inside a unit)."""

    start: int
    stop: int
    unit_samples: int


class Skip(NamedTuple):
    """What a reader reads of one unit: all of it but its first ``samples`` (a shard-level split
    resumed inside the unit, ``resume.resume_units``)."""

    samples: int


class Steps(NamedTuple):
    """One reader's batches in an epoch (EQUAL-STEPS): how many, the sizes of its last ones when
    its last full batch is split (else ``()``), and the samples it repeats (0 but where nothing
    else keeps its rank in step)."""

    batches: int
    tail: tuple[int, ...]
    pad: int


@dataclass(frozen=True)
class Span:
    """One reader's share of one epoch.

    segments: what it reads, in order (the last ``pad`` samples repeat one already read).
    batches:  how many batches it yields (``None`` without a batch size).
    tail:     sizes of its last batches when the plan splits one (EQUAL-STEPS), else ``()``.
    pad:      samples it repeats so that its rank keeps step (0 but in degenerate cases).
    dropped:  samples of the epoch that no reader yields (``drop_last``); the same on every reader.
    sizes:    its batch sizes, when not the above (a resumed span that continues, ``resume``).
    """

    segments: tuple[Segment, ...]
    batches: int | None = None
    tail: tuple[int, ...] = ()
    pad: int = 0
    dropped: int = 0
    sizes: tuple[int, ...] | None = None

    @property
    def samples(self) -> int:
        return sum(len(s) for s in self.segments)


def reader_span(counts: Sequence[int] | np.ndarray, world: World, *, seed: int = 0, epoch: int = 0,
                shuffle: bool = False, batch_size: int | None = None, drop_last: bool = False) -> Span:
    """This reader's span of the epoch, for units holding ``counts[i]`` samples each."""
    counts = np.asarray(counts, dtype=np.int64)
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle)
    ends = np.cumsum(counts[order])
    total = int(ends[-1]) if len(ends) else 0
    slots, slot = world.slots, world.slot
    if drop_last and batch_size is not None:
        per = total // (slots * batch_size) * batch_size
        used = per * slots
        offset = 0 if used == total else int(np.random.default_rng([seed, epoch, 1]).integers(total))
        first = offset + slot * per
        return Span(segments_of(order, ends, first, first + per), per // batch_size, (), 0, total - used)
    sizes = slot_sizes(total, world)
    first = int(sizes[:slot].sum())
    mine = int(sizes[slot])
    segments = segments_of(order, ends, first, first + mine)
    if batch_size is None:
        return Span(segments)
    batches, tail, pad = reader_steps(sizes, world, batch_size)
    if pad:
        segments += segments_of(order, ends, first if mine else 0, (first if mine else 0) + pad)
    return Span(segments, batches, tail, pad)


def batch_sizes(span: Span, batch_size: int) -> list[int]:
    """The sizes of the batches ``span`` yields, in order (full ones, then its ``tail``)."""
    if span.batches is None:
        raise ValueError("a span planned without a batch size has no batch sizes")
    if span.sizes is not None:
        return list(span.sizes)
    if span.tail:
        return [batch_size] * (span.batches - len(span.tail)) + list(span.tail)
    if not span.batches:
        return []
    return [batch_size] * (span.batches - 1) + [span.samples - (span.batches - 1) * batch_size]


def slot_sizes(total: int, world: World) -> np.ndarray:
    """Samples per slot of ``world`` (in slot order) when ``total`` samples are divided: equal
    within one; the extras dealt to worker 0 of every rank, then worker 1 of every rank, ... (so
    ranks differ by at most one extra). ``resume`` divides what is left of an epoch the same way."""
    slots = world.slots
    q, extra = divmod(total, slots)
    slot = np.arange(slots)
    dealt = (slot % world.num_workers) * world.world_size + slot // world.num_workers
    return q + (dealt < extra).astype(np.int64)


def reader_steps(sizes: np.ndarray, world: World, batch_size: int) -> Steps:
    """The steps of ``world``'s reader when the slots hold ``sizes`` samples (``slot_sizes``),
    so that every rank yields as many batches as the rank with most (EQUAL-STEPS)."""
    per_reader = -(-sizes // batch_size)
    per_rank = per_reader.reshape(world.world_size, world.num_workers).sum(axis=1)
    target, mine = int(per_rank.max()), int(per_reader[world.slot])
    deficit = target - int(per_rank[world.rank])
    if deficit == 0:
        return Steps(mine, (), 0)
    # the first ``deficit`` readers of this rank without an extra sample each add one batch
    rank_sizes = sizes[world.rank * world.num_workers:(world.rank + 1) * world.num_workers]
    helpers = [w for w in range(world.num_workers) if rank_sizes[w] == rank_sizes.min()][:deficit]
    if world.worker not in helpers:
        return Steps(mine, (), 0)
    n = int(sizes[world.slot])
    if n > mine:  # enough samples for one batch more: split the last full one
        last = n - (mine - 1) * batch_size
        return Steps(mine + 1, (math.ceil(last / 2), last // 2), 0)
    return Steps(mine + 1, (), 1)  # batch_size 1 or an empty reader: repeat one sample


def segments_of(order: np.ndarray, ends: np.ndarray, start: int, stop: int) -> tuple[Segment, ...]:
    """Positions ``[start, stop)`` of an epoch's sequence (wrapping past its end) as segments:
    ``order`` holds the units in the epoch's order, ``ends`` the cumulated sample counts in that
    order (``ends[i]``: the epoch position where unit ``order[i]`` ends)."""
    total = int(ends[-1]) if len(ends) else 0
    if stop <= start or total == 0:
        return ()
    out: list[Segment] = []
    while start < stop:
        pos = start % total
        i = int(np.searchsorted(ends, pos, side="right"))
        unit_start = int(ends[i - 1]) if i else 0
        take = min(stop - start, int(ends[i]) - pos)
        out.append(Segment(int(order[i]), pos - unit_start, pos - unit_start + take))
        start += take
    return tuple(out)
