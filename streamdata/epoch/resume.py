"""Mid-epoch resume plans: what is left of an epoch, re-divided over a (possibly new) world. Pure, no I/O.

A saved position is a list of *stages*: the world shape a part of the epoch ran on and how many
samples each of its readers had delivered (``delivered[slot]``). The epoch's samples are a
*sequence* of epoch positions (``plan``: units in the epoch's seeded order); a stage cuts its
sequence into one equal contiguous span per slot, exactly as ``plan.reader_span`` does, and
what its readers had not delivered (the rest of every span, in slot order) is the next stage's
sequence. The reader of the new world then gets its span of the last sequence:

- the same world shape as the last stage (RESUME-CONTINUES): each reader continues its own span
  where it stopped, with the rest of its planned batch sizes (so ranks stay in step as before);
- another world shape (RESUME-ELASTIC): what is left is re-divided into equal spans with
  EQUAL-STEPS (``plan``): equal within one sample, the same number of batches on every rank
  (a split tail, or a repeated sample where nothing else works); with ``drop_last`` every reader
  gets the same whole number of full batches and the rest of what is left is left out.

Every stage holds one integer per reader; sequences are lists of position intervals, at most
one per reader of the stage before, so a reader plans in O(units + readers of every stage).
Positions are prefixes of spans: a reader's first ``delivered`` samples (the pass's shuffle
buffer, which delivers out of order, is handled by the caller: see docs/resume.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from streamdata.epoch.plan import (
    Segment,
    Span,
    batch_sizes,
    reader_span,
    reader_steps,
    segments_of,
    slot_sizes,
)
from streamdata.epoch.sharding import epoch_order
from streamdata.epoch.world import World
from streamdata.errors import SpecError

__all__ = ["Stage", "UnitPosition", "UnitStart", "resume_span", "resume_units"]

Interval = tuple[int, int]  # epoch positions [a, b) (past the epoch's end: wrapped)
Runs = Callable[[World, Sequence[int], int], list[Interval]]  # (``rewind.undelivered``)
P = TypeVar("P")  # a reader's position: samples delivered (int), a ``UnitPosition``, a Mix's entry


class UnitPosition(NamedTuple):
    """A reader's position in a shard-level split (units' sample counts unknown): the units of
    its list read whole, and the samples delivered of the next. Saved as ``[done, into]``."""

    done: int
    into: int


class UnitStart(NamedTuple):
    """A unit to read in a resumed shard-level split: its index, and the samples of it to skip."""

    unit: int
    skip: int


class Stage(Generic[P]):
    """A world shape ``(world_size, num_workers)`` and each of its readers' positions
    (``delivered[slot]``; ``None`` where this process does not know it)."""

    def __init__(self, world_size: int, num_workers: int, delivered: Sequence[P | None]) -> None:
        self.world_size, self.num_workers = int(world_size), int(num_workers)
        self.delivered: list[P | None] = list(delivered)
        if len(self.delivered) != self.world_size * self.num_workers:
            raise SpecError(f"a resume stage of {world_size} ranks x {num_workers} workers needs "
                            f"{world_size * num_workers} positions, got {len(self.delivered)}")

    @classmethod
    def own(cls, world: World, position: P | None) -> Stage[P]:
        """A stage of ``world``'s shape where only ``world``'s own reader's position is known."""
        delivered: list[P | None] = [None] * world.slots
        delivered[world.slot] = position
        return cls(world.world_size, world.num_workers, delivered)

    def known(self) -> list[P]:
        """Every reader's position; SpecError naming the readers this stage lacks (a state saved
        without them resumes only on the same world shape)."""
        missing = [s for s, d in enumerate(self.delivered) if d is None]
        if missing:
            shape = f"{self.world_size} ranks x {self.num_workers} workers"
            raise SpecError(f"the saved position lacks readers {missing[:8]} of its {shape}: it can only "
                            "resume on that same world shape; save "
                            "every reader's position (sd.loader's Loader.state_dict()) to resume on another")
        return [d for d in self.delivered if d is not None]

    def same_shape(self, world: World) -> bool:
        return (self.world_size, self.num_workers) == (world.world_size, world.num_workers)

    def world(self, slot: int) -> World:
        return World(slot // self.num_workers, self.world_size, slot % self.num_workers, self.num_workers)


def _length(seq: Sequence[Interval]) -> int:
    return sum(b - a for a, b in seq)


def _sub(seq: Sequence[Interval], start: int, stop: int) -> list[Interval]:
    """Positions ``[start, stop)`` of the sequence ``seq`` as epoch-position intervals."""
    out: list[Interval] = []
    at = 0
    for a, b in seq:
        if at >= stop:
            break
        lo, hi = max(start - at, 0), min(stop - at, b - a)
        if hi > lo:
            out.append((a + lo, a + hi))
        at += b - a
    return out


def _cuts(length: int, stage_world: World, batch_size: int | None, drop_last: bool) -> np.ndarray:
    """Samples per slot of a stage over a sequence of ``length`` (``plan``'s rules, offset 0)."""
    if drop_last and batch_size is not None:
        per = length // (stage_world.slots * batch_size) * batch_size
        return np.full(stage_world.slots, per, dtype=np.int64)
    return slot_sizes(length, stage_world)


def resume_span(counts: Sequence[int] | np.ndarray, stages: Sequence[Stage[int]], world: World, *,
                seed: int = 0, epoch: int = 0, shuffle: bool = False, batch_size: int | None = None,
                drop_last: bool = False, undelivered: Runs | None = None) -> Span:
    """This reader's span of what ``stages`` left of the epoch (``plan.reader_span`` if none).

    The returned span's ``sizes`` are its batch sizes when it continues a span (RESUME-CONTINUES);
    ``dropped`` counts only what this resume leaves out (``drop_last``). ``undelivered(world,
    sizes, d)``, when given, says which runs of a reader's span (of segments of ``sizes``) its
    first ``d`` deliveries left out (a shuffle buffer delivers out of order: ``rewind``); else a
    reader delivered the first ``d`` samples of its span."""
    if not stages:
        return reader_span(counts, world, seed=seed, epoch=epoch, shuffle=shuffle, batch_size=batch_size,
                           drop_last=drop_last)
    counts = np.asarray(counts, dtype=np.int64)
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle)
    ends = np.cumsum(counts[order])
    total = int(ends[-1]) if len(ends) else 0
    # the first stage is the epoch's own plan: its sequence starts at drop_last's seeded offset
    offset = 0
    if drop_last and batch_size is not None:
        slots = stages[0].world_size * stages[0].num_workers
        if total // (slots * batch_size) * batch_size * slots != total:
            offset = int(np.random.default_rng([seed, epoch, 1]).integers(total))
    seq: list[Interval] = [(offset, offset + total)] if total else []
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        if last and stage.same_shape(world):
            return _continue(order, ends, seq, stage, world, batch_size, drop_last)
        seq = _leftover(seq, stage, batch_size, drop_last, order, ends, undelivered)
    return _divide(order, ends, seq, world, batch_size, drop_last)


def _leftover(seq: list[Interval], stage: Stage[int], batch_size: int | None, drop_last: bool,
              order: np.ndarray, ends: np.ndarray, undelivered: Runs | None = None) -> list[Interval]:
    """What the readers of ``stage`` had not delivered of their spans of ``seq``, in slot order."""
    delivered = stage.known()
    own = _cuts(_length(seq), stage.world(0), batch_size, drop_last)
    firsts = np.concatenate(([0], np.cumsum(own)[:-1]))
    out: list[Interval] = []
    for slot, d in enumerate(delivered):
        first, n = int(firsts[slot]), int(own[slot])
        d = min(max(int(d), 0), n)
        if undelivered is None or d == 0 or d == n:
            out += _sub(seq, first + d, first + n)
            continue
        sizes = [len(s) for s in _to_segments(order, ends, _sub(seq, first, first + n))]
        for a, b in undelivered(stage.world(slot), sizes, d):
            out += _sub(seq, first + a, first + b)
    return out


def _to_segments(order: np.ndarray, ends: np.ndarray, intervals: Sequence[Interval]) -> tuple[Segment, ...]:
    return tuple(seg for a, b in intervals for seg in segments_of(order, ends, a, b))


def _continue(order: np.ndarray, ends: np.ndarray, seq: list[Interval], stage: Stage[int], world: World,
              batch_size: int | None, drop_last: bool) -> Span:
    """RESUME-CONTINUES: the rest of this reader's span of ``seq`` on the stage's world."""
    span = _divide(order, ends, seq, world, batch_size, drop_last)
    d = stage.delivered[world.slot]
    if d is None:
        raise SpecError(f"the saved position has no entry for {world.describe()}")
    d = min(max(int(d), 0), span.samples)
    segments: list[Segment] = []
    skip = d
    for seg in span.segments:
        if skip >= len(seg):
            skip -= len(seg)
            continue
        segments.append(Segment(seg.unit, seg.start + skip, seg.stop))
        skip = 0
    own = span.samples - span.pad
    pad = span.pad - max(0, d - own)
    if span.batches is None or batch_size is None:
        return Span(tuple(segments), None, (), pad)
    sizes: list[int] = []
    done = d
    for size in batch_sizes(span, batch_size):
        take = min(size, done)
        done -= take
        if size > take:
            sizes.append(size - take)
    return Span(tuple(segments), len(sizes), (), pad, 0, tuple(sizes))


def _divide(order: np.ndarray, ends: np.ndarray, seq: list[Interval], world: World,
            batch_size: int | None, drop_last: bool) -> Span:
    """RESUME-ELASTIC: this reader's equal span of ``seq`` (``plan``'s rules, EQUAL-STEPS)."""
    length = _length(seq)
    sizes = _cuts(length, world, batch_size, drop_last)
    first, mine = int(sizes[:world.slot].sum()), int(sizes[world.slot])
    segments = _to_segments(order, ends, _sub(seq, first, first + mine))
    if batch_size is None:
        return Span(segments)
    if drop_last:
        return Span(segments, mine // batch_size, (), 0, length - int(sizes.sum()))
    batches, tail, pad = reader_steps(sizes, world, batch_size)
    if pad and length:
        start = first if mine else 0
        segments += _to_segments(order, ends, _sub(seq, start, start + pad))
    return Span(segments, batches, tail, pad if length else 0)


def resume_units(n_units: int, stages: Sequence[Stage[UnitPosition]], world: World, *, seed: int = 0,
                 epoch: int = 0, shuffle: bool = False) -> list[UnitStart]:
    """A shard-level split's resume (units' sample counts unknown): the units this reader reads,
    in order, each with the samples of it to skip. A stage's positions are ``UnitPosition``s;
    what they left (the partly read unit, then the untouched ones) is dealt round-robin to the
    new readers (``sharding``'s EXACTLY-ONCE); the same world continues each reader's list."""
    seq = [UnitStart(int(u), 0) for u in epoch_order(n_units, seed=seed, epoch=epoch, shuffle=shuffle)]
    for i, stage in enumerate(stages):
        slots = stage.world_size * stage.num_workers
        if i == len(stages) - 1 and stage.same_shape(world):
            return _rest(seq[world.slot::slots], stage.delivered[world.slot], world)
        delivered = stage.known()
        seq = [item for k in range(slots)
               for item in _rest(seq[k::slots], delivered[k], stage.world(k))]
    return seq[world.slot::world.slots]


def _rest(mine: list[UnitStart], position: UnitPosition | None, world: World) -> list[UnitStart]:
    if position is None:
        raise SpecError(f"the saved position has no entry for {world.describe()}")
    done, into = (int(x) for x in position)
    rest = list(mine[done:])
    if rest and into:
        rest[0] = UnitStart(rest[0].unit, rest[0].skip + into)
    return rest
