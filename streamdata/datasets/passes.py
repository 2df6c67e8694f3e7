"""What one reader's pass is made of: its plan (``ReaderPass``), its batching, its iterator.

Plain data and one small iterator, shared by the pass in :mod:`streamdata.datasets.sharded` and the
formats (:mod:`streamdata.datasets.tar`, :mod:`streamdata.datasets.parquet`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from streamdata.epoch.blocks import Windows
from streamdata.epoch.plan import SampleSlice, Skip, Span, batch_sizes
from streamdata.epoch.sharding import reader_seed
from streamdata.epoch.world import World
from streamdata.errors import FormatError
from streamdata.metrics import StageClock, batch_len
from streamdata.redact import redact_url

__all__ = ["Batching", "EpochIterator", "Read", "ReaderPass", "stale_count", "stages_before"]


def stale_count(url: str, seen: int, expected: int) -> FormatError:
    """A unit whose samples do not match its count (the sample index, or footers)."""
    return FormatError(f"{redact_url(url)} does not match its sample count: {seen} samples found where "
                       f"the count says {expected}; the shard changed after its index was built: run "
                       "`streamdata index SPEC` again", url=url)


def stages_before(live: Any, resume: Any, epoch: int, world: World) -> list:
    """The stages of ``epoch`` that ran before the one a pass of ``world``'s shape reads in (what
    ``len()`` counts as delivered): the pass under way's (``live.before``), else those of a state
    loaded for that epoch less the last where the pass continues it (RESUME-CONTINUES); none at
    the epoch's start."""
    if live is not None and live.epoch == epoch:
        return list(live.before)
    if resume is None or resume.epoch != epoch:
        return []
    stages = list(resume.stages)
    return stages[:-1] if stages and stages[-1].same_shape(world) else stages


class EpochIterator:
    """One reader's pass over its share of an epoch; creating it starts the fetch.

    Closing it (explicitly, at exhaustion, on error, or when garbage-collected after an
    early ``break``) closes the prefetcher: no thread, task or connection is left behind.
    Only at exhaustion, ``keep()`` may say that the prefetcher goes on serving the next pass
    (NEXT-EPOCH-EARLY in ``sharded``): then it is not closed here.
    """

    def __init__(self, items: Iterator[Any], close: Callable[[], None], *,
                 keep: Callable[[], bool] | None = None, clock: StageClock | None = None,
                 batched: bool = True) -> None:
        self._items = items
        self._close: Callable[[], None] | None = close
        self._keep = keep
        self._clock = clock  # the pass's stage timings: each batch's next() is the reader's busy time
        self._batched = batched  # items are batches (``metrics.batch_len``), else samples

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._close is None:
            raise StopIteration
        try:
            if self._clock is None:
                return next(self._items)
            acc = self._clock.acc
            start = time.perf_counter_ns()
            try:
                item = next(self._items)
            finally:
                now = time.perf_counter_ns()
                acc[StageClock.BUSY] += now - start
            if self._batched:
                acc[StageClock.BATCHES] += 1
                acc[StageClock.SAMPLES] += batch_len(item)
            else:
                acc[StageClock.SAMPLES] += 1
            if self._clock.due(now):
                self._clock.flush(now)
            return item
        except StopIteration:
            self.close(finished=True)
            raise
        except BaseException:
            self.close()
            raise

    def close(self, finished: bool = False) -> None:
        """End the pass; ``finished``: it ran to its end (only then may ``keep`` keep the fetch)."""
        close, self._close = self._close, None
        if close is not None:
            if self._clock is not None:
                with contextlib.suppress(Exception):  # best effort when collected at exit
                    self._clock.flush()
            getattr(self._items, "close", lambda: None)()
            if not (finished and self._keep is not None and self._keep()):
                close()

    def __del__(self) -> None:
        self.close()


class Read(NamedTuple):
    """One unit of a pass and what of it to read: ``None``, all of it (a shard-level split,
    EXACTLY-ONCE in ``sharding``); a ``SampleSlice``, samples ``[start, stop)`` of its ``count``
    (an exact epoch's ``span``, EQUAL-STEPS in ``plan``); a ``Skip``, all but its first samples
    (a shard-level split resumed, ``resume``)."""

    unit: Any
    part: SampleSlice | Skip | None = None


@dataclass(frozen=True)
class ReaderPass:
    """What one reader reads in one pass: where it stands, the epoch, and its reads in order.

    A pass is a pure function of the dataset's units, ``(seed, epoch)`` and the world, so a
    saved position in it is all a resume needs.
    """

    world: World
    epoch: int
    reads: list[Read]
    span: Span | None = None
    windows: Windows | None = None  # BLOCK-SHUFFLE: how the reads are put out, else None

    @property
    def units(self) -> list[Any]:
        return [read.unit for read in self.reads]

    def seed(self, seed: int) -> list[int]:
        """Seed material for this reader's shuffle in this pass."""
        return reader_seed(self.world, seed=seed, epoch=self.epoch)

    def batch_sizes(self, batch_size: int | None) -> list[int] | None:
        """The planned size of each batch this reader yields (an exact epoch), else None."""
        if self.span is None or batch_size is None:
            return None
        return batch_sizes(self.span, batch_size)


@dataclass(frozen=True)
class Batching:
    """How a pass groups its samples: ``batch_size`` None yields samples one by one."""

    batch_size: int | None
    drop_last: bool = False
    collate_fn: Callable[[list], Any] | None = None
    in_flight: int | None = None
    sizes: list[int] | None = None  # the plan's batch sizes (EQUAL-STEPS), when it has one
    windows: Windows | None = None  # the block shuffle's windows, else a buffer's shuffle
