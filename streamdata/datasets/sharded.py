"""The sharded datasets' one pass: spec -> plan -> prefetcher -> records -> map -> shuffle -> batch.

:class:`ShardedDataset` owns the epoch pass for every format: the reader's world, its plan
of units for the epoch, the prefetcher, the error policy, ``map``, the shuffle, batching and
the epoch iterator. A format supplies only what a unit is and how a fetched unit becomes
records (``fetch_item`` and ``read_unit``); :class:`~streamdata.datasets.tar.TarDataset` is that
for tar shards, and :mod:`streamdata.datasets.parquet` for Parquet row groups and Arrow record batches
(whose records are Arrow tables, shuffled and batched at table level by ``stages``).
"""

from __future__ import annotations

import functools
import logging
import random
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data

from streamdata._compat import dataloader_asking, prepared_by_accelerate
from streamdata._fork import install
from streamdata.batch.batches import batches
from streamdata.catalog.specs import Sightings, Spec, expand_spec
from streamdata.config import FetchConfig, stage_times
from streamdata.datasets.passes import Batching, EpochIterator, Read, ReaderPass, stages_before, stale_count
from streamdata.epoch import blocks
from streamdata.epoch.buffer import shuffled
from streamdata.epoch.plan import SampleSlice, Segment, Skip, Span, batch_sizes
from streamdata.epoch.resume import Stage, resume_span, resume_units
from streamdata.epoch.rewind import Rewind, dropped, placeholder_items, rewind_point, skipped, undelivered
from streamdata.epoch.sharding import assign
from streamdata.epoch.state import (
    STATE_FORMAT,
    Loaded,
    Position,
    check_batching,
    dataset_key,
    parse_state,
    reader_state,
)
from streamdata.epoch.world import World, pinned
from streamdata.errors import SpecError, StreamDataError
from streamdata.fetch.prefetcher import FetchItem, ItemReader, Prefetcher
from streamdata.formats.seeding import for_pass
from streamdata.metrics import COUNTERS, READER_STATS, Counters, StageClock
from streamdata.policy import ErrorPolicy, OnError
from streamdata.ranks import DataParallel, data_parallel, from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard

__all__ = ["Batching", "EpochIterator", "ReaderPass", "ShardedDataset", "stale_count"]

log = logging.getLogger("streamdata")

DEFAULT_SHUFFLE_BUFFER = 512  # samples, per reader, with shuffle=True
DECODE_TIMEOUT = 300.0  # seconds one sample may take on the decode threads (``decode_threads``)
_OWN: Any = object()  # ``steps``: the dataset's own batch size


@dataclass(frozen=True)
class _Prepared:
    """A record's ``prepare`` then ``map``: one call on a decode thread."""

    prepare: Callable[[Any], Any]
    map: Callable[[Any], Any] | None

    def __call__(self, record: Any) -> Any:
        sample = self.prepare(record)
        return sample if self.map is None else self.map(sample)


@dataclass(frozen=True)
class _Early:
    """A pass queued in the prefetcher of the pass before it, from item ``first`` on
    (NEXT-EPOCH-EARLY): its requests go out as soon as that pass's last part is requested."""

    p: ReaderPass
    reads: list[Read]
    fetcher: Prefetcher
    first: int


def refuse_resplitting(caller: Any) -> None:
    """SELF-SPLIT: a streamdata dataset reads its own share of each epoch on each rank. A plain
    DataLoader over it that ``accelerator.prepare()`` wrapped splits it again (rank 0's share
    dispatched to every rank, or each rank's share cut by ``IterableDatasetShard``): part of the
    epoch would never be read. Such a loader calls ``set_epoch`` as it starts: refuse it there."""
    wrapper = prepared_by_accelerate(caller)
    if wrapper is not None and (World.current().world_size > 1 or wrapper == "DataLoaderDispatcher"):
        raise SpecError(
            f"accelerate's prepare() wrapped a DataLoader over a streamdata dataset ({wrapper}): the dataset "
            "already reads one share of the epoch per rank, and accelerate would split that share again "
            "(dispatch_batches: rank 0's share sent to every rank; otherwise IterableDatasetShard drops part "
            "of each rank's), so part of every epoch would never be read. Build the loader with "
            "sd.loader(ds, ...): prepare() passes it through unchanged (docs/frameworks.md)")


class ShardedDataset(torch.utils.data.IterableDataset):
    """The pass every sharded dataset shares; subclasses say what a unit is and read it.

    The spec is expanded (and validated) here, in the constructing process, before any
    worker starts. Each ``iter()`` reads this reader's share of the epoch. Fetch options come as
    groups, ``fetch=sd.Fetch(...)``, ``retry=sd.Retry(...)``, ``cache=sd.Cache(...)`` (the flat
    keywords of the same names are deprecated), or ``fetch_config=`` (:meth:`FetchConfig.resolve`).
    ``shuffle``: True (the block shuffle where
    sample counts are known, ``blocks``; else a buffer), ``"block"`` or ``"buffer"``. Skips under
    ``on_error`` and retries are counted in :attr:`skipped` and :attr:`retried`, over every worker.
    ``listing=False``: the spec is not listed (``expand_spec``'s NO-LISTING; docs/startup.md).
    ``decode_threads``: threads per reader that decode and ``map`` samples (docs/images.md).
    """

    suffixes: tuple[str, ...] = ()
    fetch_defaults: dict[str, Any] = {}  # a format's own defaults (FetchConfig.resolve)
    default_shuffle_buffer = DEFAULT_SHUFFLE_BUFFER

    def __init__(self, spec: Spec, *, storage_options: dict | None = None, shuffle: bool | str = False,
                 seed: int = 0, shuffle_buffer: int | None = None, shuffle_window: int | None = None,
                 batch_size: int | None = None,
                 drop_last: bool = False, collate_fn: Callable[[list], Any] | None = None,
                 map: Callable[[Any], Any] | None = None, on_error: OnError = "raise",
                 fetch_config: FetchConfig | None = None, listing: bool = True,
                 decode_threads: int = 1, dp_rank: int | None = None, dp_size: int | None = None,
                 mesh: Any = None, group: Any = None, **fetch_options: Any) -> None:
        super().__init__()
        # the replicas that split the data, where ranks of one replica share it (``ranks``)
        self.data_parallel: DataParallel | None = data_parallel(dp_rank, dp_size, mesh=mesh, group=group)
        if not isinstance(decode_threads, int) or decode_threads < 1:
            raise SpecError(f"decode_threads must be an int >= 1, got {decode_threads!r}")
        self.decode_threads = decode_threads  # threads per reader for decode and map (``stages``)
        if batch_size is not None and batch_size < 1:
            raise SpecError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.fetch_config = FetchConfig.resolve(fetch_config, self, defaults=self.fetch_defaults,
                                                **fetch_options)
        self.on_error = ErrorPolicy.validate(on_error)  # in the main process, before any worker
        self.storage_options = dict(storage_options or {})
        sightings = self.before_listing(spec, listing)
        # one listing per job: rank 0 expands the spec for every rank (LIST-ONCE); listing=False:
        # none, sizes from the readers' first GETs (NO-LISTING, ``catalog.specs.expand_spec``)
        self.shards: list[Shard] = from_rank0(lambda: expand_spec(
            spec, self.storage_options, suffixes=self.suffixes, config=self.fetch_config,
            listing=listing, sightings=sightings))
        blocks.check_shuffle_option(shuffle, shuffle_window)  # True/"block"/"buffer" (``blocks``)
        self.shuffle, self.shuffle_mode = bool(shuffle), shuffle if isinstance(shuffle, str) else None
        self.shuffle_window, self.buffer_given = shuffle_window, shuffle_buffer is not None
        self.seed = seed
        self.shuffle_buffer = ((self.default_shuffle_buffer if shuffle else 0) if shuffle_buffer is None
                               else shuffle_buffer)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn  # None: each sample into a shared-memory batch as it comes
        self.map = map
        self._map = map  # ``map`` bound to the current pass (``start_pass``)
        self._counters = Counters(COUNTERS)
        self._stats = Counters(READER_STATS)  # each reader's stage timings and requests (``reader_stats``)
        self._epoch = 0
        self._passes = 0
        self.early_next_epoch = False  # NEXT-EPOCH-EARLY; sd.loader sets it for persistent workers
        self._early: _Early | None = None
        self._resume: Loaded | None = None  # load_state_dict's, for its epoch
        self._live: Position | None = None  # the current pass's position (state_dict)
        self._window: tuple[tuple, int | None] | None = None  # block_window's, for its options
        self._state_key: tuple[tuple, tuple[str, str]] | None = None  # state_key's, for its options

    # ---- epochs and counts ------------------------------------------------------------

    def world(self) -> World:
        """This reader's place: among the data-parallel replicas where the dataset was given them
        (``dp_rank``/``dp_size``, ``mesh``, ``group``), else among all ranks."""
        return World.current(self.data_parallel)

    def set_data_parallel(self, place: DataParallel | None) -> None:
        """Read as replica ``place.rank`` of ``place.size`` (``sd.loader(dp_rank=..., mesh=...)``)."""
        if place is not None and self.data_parallel is not None and place != self.data_parallel:
            raise SpecError(f"the dataset was built for data-parallel place {self.data_parallel}, the "
                            f"loader gives {place}: give it once")
        if place is not None:
            self.data_parallel = place

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle to read next (call before each epoch, as with
        ``DistributedSampler``).  A persistent worker's copy of the dataset cannot see this
        call, so inside a DataLoader worker the epoch also advances by one per pass: calling
        ``set_epoch(0), set_epoch(1), ...`` gives the same orders with or without persistence."""
        refuse_resplitting(sys._getframe(1))
        self._epoch = int(epoch)
        self._passes = 0
        self._live = None  # state_dict(): this epoch's start

    @property
    def epoch(self) -> int:
        return self._epoch + self._passes

    @property
    def skipped(self) -> dict[str, int]:
        """Records and units skipped under ``on_error`` so far, per reason, summed over this
        process and its DataLoader workers (``metrics.SKIP_REASONS``)."""
        return self._counters.snapshot("skipped.")

    @property
    def retried(self) -> dict[str, int]:
        """Requests tried again so far, per reason, over every worker (``metrics.RETRY_REASONS``)."""
        return self._counters.snapshot("retried.")

    @property
    def resigned(self) -> dict[str, int]:
        """Presigned S3 URLs signed again so far, per reason, over every worker
        (``metrics.RESIGN_REASONS``: age, expired, refused)."""
        return self._counters.snapshot("resigned.")

    @property
    def counts(self) -> dict[str, int]:
        """Every counter (``skipped.*``, ``retried.*``, ``accepted.*``, ``budget.grown``, ...:
        ``metrics.COUNTERS``), over every worker."""
        return self._counters.snapshot()

    def reader_stats(self) -> list[dict[str, int]]:
        """Each reader's ``metrics.READER_STATS`` so far (nanoseconds and counts), one dict per
        reader that read (the main process's first, with ``num_workers=0``)."""
        return self._stats.rows()

    def __len__(self) -> int:
        """What this rank yields this epoch: batches with a ``batch_size``, else samples
        (:meth:`steps`). A DataLoader asking counts with its ``num_workers``; anyone else, one
        reader per rank. TypeError where the plan does not know (no sample counts)."""
        asking = dataloader_asking(sys._getframe(1))
        return self.steps(num_workers=asking.num_workers if asking is not None else 0)

    def steps(self, batch_size: int | None | Any = _OWN, drop_last: bool | None = None, *,
              num_workers: int = 0) -> int:
        """The batches this rank yields this epoch with ``num_workers`` readers (``batch_size``
        None: samples), from the plan alone: the same on every rank (EQUAL-STEPS). The dataset's
        own ``batch_size`` and ``drop_last`` unless given. An epoch resumed on another world shape
        counts what the ranks delivered before the resume with what is left, when that is more
        than a whole epoch's (a framework that counts the steps it trained reaches the end with
        the loader). TypeError where the sample counts are unknown (a shard-level split)."""
        if batch_size is _OWN:
            batch_size = self.batch_size
        drop_last = self.drop_last if drop_last is None else bool(drop_last)
        if self.sample_counts() is None:
            raise TypeError(
                f"{type(self).__name__} over {redact_url(self.shards[0].url)!r}... has no length: the "
                "samples of its shards are unknown until they are read. Build the sample index "
                "(`streamdata index SPEC`, tar), or give the trainer the steps to run (max_steps=...)")
        world = self.world()
        nw = max(int(num_workers), 1)
        earlier: list[Stage] = stages_before(self._live, self._resume, self.epoch,
                                             World(world.rank, world.world_size, 0, nw))

        def spans(before: list[Stage], world_size: int, workers: int, rank: int) -> list[Span]:
            """The spans of ``rank``'s readers in a stage of that shape that began after ``before``."""
            out = []
            for w in range(workers):
                with pinned(World(rank, world_size, w, workers)):
                    span = self._plan_pass(self.epoch, batch_size, drop_last, before).span
                assert span is not None  # (sample counts known: an exact epoch)
                out.append(span)
            return out

        def steps(span: Span, delivered: int | None = None) -> int:
            """A span's steps, or those its first ``delivered`` samples made (a saved position
            stands between two of its batches)."""
            if batch_size is None:
                return span.samples if delivered is None else min(delivered, span.samples)
            sizes = batch_sizes(span, batch_size)
            return len(sizes) if delivered is None else int(np.searchsorted(np.cumsum(sizes), delivered,
                                                                            side="right"))

        whole = sum(steps(s) for s in spans([], world.world_size, nw, world.rank))
        if not earlier:
            return whole
        done = 0  # steps delivered in the stages before this one: the most any rank delivered
        for i, stage in enumerate(earlier):
            delivered = stage.known()
            done += max(sum(steps(span, int(delivered[rank * stage.num_workers + w])) for w, span in
                            enumerate(spans(earlier[:i], stage.world_size, stage.num_workers, rank)))
                        for rank in range(stage.world_size))
        return max(whole, done + sum(steps(s) for s in spans(earlier, world.world_size, nw, world.rank)))

    # ---- what a format supplies --------------------------------------------------------

    def units(self) -> Sequence[Any]:
        """The work units split across readers (shards here; row groups for Parquet)."""
        return self.shards

    def sample_counts(self) -> np.ndarray | None:
        """Samples in each unit (aligned with :meth:`units`) when known without reading them
        (a tar index, Parquet footers): the pass is then an exact epoch (``plan``); None: units
        are split whole (``sharding``)."""
        return None

    def before_listing(self, spec: Spec, listing: bool) -> Sightings | None:
        """Requests a format can send while the spec is listed (a tar index, ``catalog.index_ahead``);
        the names the listing should note (``specs.Sightings``), if any."""
        return None

    def fetch_item(self, unit: Any) -> FetchItem:
        """What to fetch for ``unit``: its object, whole or as byte ranges."""
        return FetchItem(unit.url, unit.size, None, self.etag(unit.url))

    def etag(self, url: str) -> str | None:
        """The listing's ETag of the object at ``url`` (part of a cache entry's key), if any."""
        return self._etags.get(url)

    @functools.cached_property
    def _etags(self) -> dict[str, str | None]:
        return {s.url: getattr(s, "etag", None) for s in self.shards}

    def read_unit(self, unit: Any, reader: ItemReader) -> Iterable[Any]:
        """A fetched unit's records, in order."""
        raise NotImplementedError

    def fetch_segment(self, unit: Any, start: int, stop: int, count: int) -> FetchItem:
        """What to fetch for samples ``[start, stop)`` of ``unit`` (of ``count``): all of it
        unless a format knows where its samples lie (a tar index's offsets)."""
        return self.fetch_item(unit)

    def read_segment(self, unit: Any, start: int, stop: int, count: int,
                     reader: ItemReader) -> Iterator[Any]:
        """Records ``[start, stop)`` of ``unit`` (records are samples here), read from its start.
        A unit that does not hold the ``count`` records its count says (fewer than ``stop``, or,
        read to its end, more than ``count``) is a stale count: FormatError."""
        seen = 0
        records = iter(self.read_unit(unit, reader))
        try:
            for seen, record in enumerate(records, 1):
                if seen > start and seen <= stop:
                    yield record
                elif seen > stop and stop < count:
                    return  # the rest is another reader's
            if seen != count:
                raise stale_count(reader.url, seen, count)
        finally:
            getattr(records, "close", lambda: None)()

    def ranged_segments(self) -> bool:
        """Whether a unit's samples ``[start, stop)`` are fetched alone (``fetch_segment``), so a
        block shuffle's windows may cut units (``blocks``)."""
        return False

    def block_window(self) -> int | None:
        """The block shuffle's window in samples (``blocks``), or None: a shuffle buffer, or none."""
        key = (self.shuffle, self.shuffle_mode, self.shuffle_window)
        if self._window is None or self._window[0] != key:
            self._window = (key, blocks.window_for(self))
        return self._window[1]

    def state_key(self) -> tuple[str, str]:
        """The dataset's fingerprint and split in a state (``state.dataset_key``), worked out
        once per (seed, shuffle): a worker's ``state_dict`` runs after every batch."""
        key = (self.seed, self.shuffle)
        if self._state_key is None or self._state_key[0] != key:
            self._state_key = (key, dataset_key(self))
        return self._state_key[1]

    def prepare(self, record: Any) -> Any:
        """One record made ready for the shuffle and the batch (decoding); errors are
        handled by the policy, per record."""
        return record

    def start_pass(self, epoch: int) -> None:
        """Bind what is seeded per sample to this pass's seed and epoch (``formats.seeding``: an
        image transform or a media clip as ``map``); formats bind their decoders too."""
        self._map = for_pass(self.map, self.seed, epoch)

    # ---- the pass -----------------------------------------------------------------------

    def reader_pass(self, batch_size: int | None = None, drop_last: bool = False) -> ReaderPass:
        """This reader's pass of the current epoch (and, in a worker, one pass counted): an
        exact epoch's span when sample counts are known, else a shard-level split."""
        stages: list[Stage] = []
        resume, self._resume = self._resume, None
        if resume is not None and resume.epoch == self.epoch:  # load_state_dict's position, once
            stages = resume.stages
            check_batching(resume.batching or [None, False], batch_size, drop_last)
        p = self._plan_pass(self.epoch, batch_size, drop_last, stages)
        self._live = Position.of_pass(p.world, p.epoch, "units" if p.span is None else "samples", stages,
                                      [batch_size, bool(drop_last and batch_size is not None)])
        if self._live.samples_before and p.span is not None and p.windows is None and self.shuffle_buffer > 1:
            p = self._rewound(p, stages, batch_size, drop_last)
        elif p.windows is not None and p.windows.skip:  # BLOCK-SHUFFLE: its window read again
            self._counters.add("resumed.reread", p.windows.skip)
        if torch.utils.data.get_worker_info() is not None:
            self._passes += 1  # a persistent worker's copy cannot see set_epoch: count passes
        return p

    def _plan_pass(self, epoch: int, batch_size: int | None, drop_last: bool,
                   stages: list[Stage] | None = None) -> ReaderPass:
        world = self.world()
        units, counts = self.units(), self.sample_counts()
        if counts is None:
            if not stages:
                order = assign(units, world, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
                return ReaderPass(world, epoch, [Read(unit) for unit in order])
            picks = resume_units(len(units), stages, world, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
            return ReaderPass(world, epoch, [Read(units[pick.unit], Skip(pick.skip) if pick.skip else None)
                                             for pick in picks])
        window, split = self.block_window(), not self.records_are_tables and self.ranged_segments()
        buffered = self.shuffle_buffer > 1  # RESUME-ELASTIC behind a buffer: what it left out (``rewind``)
        runs = (blocks.block_runs(window, split, self.seed, epoch) if window else
                undelivered(self.shuffled, self.records_are_tables, self.seed, epoch) if buffered else None)
        def span_of(stages: list[Stage]) -> Span:
            return resume_span(counts, stages, world, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                               batch_size=batch_size, drop_last=drop_last, undelivered=runs)

        span = span_of(stages or [])
        segments: Sequence[Segment] = span.segments
        windows = None
        if window:  # BLOCK-SHUFFLE: the whole span's windows, from the one the position is in
            segments, windows = blocks.resumed_reads(span, span_of, stages or [], world, window, split,
                                                     seed=self.seed, epoch=epoch,
                                                     tables=self.records_are_tables)
        reads = [Read(units[s.unit], SampleSlice(s.start, s.stop, int(counts[s.unit]))) for s in segments]
        return ReaderPass(world, epoch, reads, span, windows)

    def _rewound(self, p: ReaderPass, stages: list[Stage], batch_size: int | None,
                 drop_last: bool) -> ReaderPass:
        """RESUME-BUFFER (``rewind``): a continued pass behind a shuffle buffer reads from the first
        sample not delivered, and its shuffle replays the original order from there."""
        def at(position: int) -> ReaderPass:
            return self._plan_pass(self.epoch, batch_size, drop_last,
                                   [*stages[:-1], Stage.own(p.world, position)])

        live, full = self._live, at(0).span
        assert live is not None and full is not None  # (a continued pass of an exact epoch: the caller's)
        d = live.samples_before
        sizes = [len(s) for s in full.segments] if self.records_are_tables else [1] * full.samples
        m = rewind_point(lambda records: self.shuffled(records, p.seed(self.seed)), sizes, d,
                         self.records_are_tables)
        live.rewind = Rewind(m, d, sizes)
        self._counters.add("resumed.reread", d - m)  # delivered, behind the first not delivered
        return ReaderPass(p.world, p.epoch, at(m).reads, p.span)

    # ---- the state: where the pass stands (``state``, ``resume``) --------------------------

    def state_dict(self) -> dict:
        """Where this reader stands in the epoch (``state``; docs/resume.md): in a worker, what it
        yielded (``StatefulDataLoader`` asks after each batch); else the one loaded, or the start."""
        batching = [self.batch_size, bool(self.drop_last and self.batch_size is not None)]
        state = reader_state(*self.state_key(), self._live, self._resume, self.epoch, batching)
        return blocks.with_mode(state, self.block_window())

    def load_state_dict(self, state: dict) -> None:
        """The next pass resumes the saved epoch at the saved position, by seeking (``resume``);
        a state of another dataset is refused (SpecError). Call it before iterating."""
        epoch, stages = parse_state(state, *self.state_key(), buffer=self.shuffle_buffer)
        blocks.check_mode(state, self.block_window())
        batching = state.get("batching") or [self.batch_size, False]
        self._resume = Loaded(epoch, stages, [batching[0], bool(batching[1])])
        self._epoch, self._passes, self._live = epoch, 0, None

    def __iter__(self) -> EpochIterator:
        return self.iter_batches(self.batch_size, drop_last=self.drop_last, collate_fn=self.collate_fn)

    def iter_batches(self, batch_size: int | None, *, drop_last: bool = False,
                     collate_fn: Callable[[list], Any] | None = None,
                     in_flight: int | None = None) -> EpochIterator:
        """This reader's pass, batched by ``batch_size`` (None: samples). ``sd.loader`` calls it
        to batch in the worker with the plan's batch sizes (EQUAL-STEPS)."""
        install()  # FORK-RESET from the first pass on (``_fork``; import installs nothing)
        p = self.reader_pass(batch_size, drop_last)
        self.start_pass(p.epoch)
        self._note_plan(p)
        clock = StageClock(self._stats) if stage_times() else None
        policy = ErrorPolicy(self.on_error, self._counters, where=p.world.describe(), clock=clock)
        early, self._early = self._early, None
        if early is not None and early.p == p:  # NEXT-EPOCH-EARLY: its requests may be out already
            reads, fetcher, first = early.reads, early.fetcher, early.first
        else:
            if early is not None:
                early.fetcher.close()
            reads, items = self._items(p, policy)
            fetcher, first = self._fetcher(items, p), 0
        fetcher.times = None if clock is None else clock.acc  # its waits for bytes, this pass's
        queued: _Early | None = None

        def queue() -> None:  # NEXT-EPOCH-EARLY
            nonlocal queued
            queued = self._queue_next(fetcher, batch_size, drop_last)

        opened = self._opened(reads, fetcher.readers(first, first + len(reads)), queue)
        records = policy.units(self._read(p, read.unit, read.part, r) for read, r in opened)
        batching = Batching(batch_size, drop_last, collate_fn, in_flight, p.batch_sizes(batch_size),
                            p.windows)
        return EpochIterator(self.stages(records, policy, p, batching), fetcher.close,
                             keep=lambda: self._hand_on(queued), clock=clock,
                             batched=batch_size is not None)

    def _read(self, p: ReaderPass, unit: Any, part: SampleSlice | Skip | None,
              reader: ItemReader) -> Iterable[Any]:
        """One read's records; a shard-level split's counted per unit (``state.Position``)."""
        if isinstance(part, SampleSlice):
            return self.read_segment(unit, *part, reader)
        records = self.read_unit(unit, reader)
        if isinstance(part, Skip):  # a resumed shard-level split: skip what was delivered before
            records = skipped(records, part.samples, lambda n: self._counters.add("resumed.reread", n))
        return records if p.span is not None or self._live is None else self._live.count_unit(records)

    def _items(self, p: ReaderPass, policy: ErrorPolicy) -> tuple[list[Read], list[FetchItem]]:
        """A pass's reads and their fetch items; a unit whose byte ranges cannot be worked out
        is a bad unit (the policy's)."""
        reads: list[Read] = []
        items: list[FetchItem] = []
        for read in p.reads:
            try:
                items.append(self.fetch_segment(read.unit, *read.part) if isinstance(read.part, SampleSlice)
                             else self.fetch_item(read.unit))
            except StreamDataError as exc:
                policy.check(exc)
                continue
            reads.append(read)
        return reads, items

    @staticmethod
    def _opened(reads: list[Read], readers: Iterator[ItemReader],
                queue: Callable[[], None]) -> Iterator[tuple[Read, ItemReader]]:
        """``(read, item reader)`` pairs; ``queue()`` runs as the second is taken (the first
        batch's reads are under way: planning the next pass, 0.2 s for a million shuffled
        shards, does not delay it), or at the end of a pass of fewer."""
        count = 0
        for count, pair in enumerate(zip(reads, readers, strict=True), 1):
            if count == 2:
                queue()
            yield pair
        if count < 2:
            queue()

    def _fetcher(self, items: list[FetchItem], p: ReaderPass) -> Prefetcher:
        """A pass's prefetcher, whose requests start now."""
        return Prefetcher(items, self.storage_options, self.fetch_config, where=p.world.describe(),
                          counters=self._counters, stats=self._stats)

    def _queue_next(self, fetcher: Prefetcher, batch_size: int | None, drop_last: bool) -> _Early | None:
        """NEXT-EPOCH-EARLY: in a persistent worker (``early_next_epoch``), the next pass (the
        same plan the next ``iter()`` computes) is queued in this pass's prefetcher behind this
        pass's items: its requests go out as soon as this pass's last part is requested, on
        the same connections, within the same byte budget. It is handed on only if this pass
        runs to its end (``_hand_on``); the next pass adopts it only if it is that same pass,
        else closes it; a worker that ends drops it with its process. A failure here is left
        for the next pass to meet."""
        if (not self.early_next_epoch or torch.utils.data.get_worker_info() is None
                or fetcher.protocol is None):  # a pass with nothing to read (a resumed span, done)
            return None
        try:
            nxt = self._plan_pass(self.epoch, batch_size, drop_last)
            reads, items = self._items(nxt, ErrorPolicy(self.on_error, self._counters,
                                                        where=nxt.world.describe()))
            return _Early(nxt, reads, fetcher, fetcher.extend(items)) if items else None
        except StreamDataError:
            return None

    def _hand_on(self, queued: _Early | None) -> bool:
        """A pass ran to its end: the next pass queued in its prefetcher, if any, is kept."""
        self._early = queued
        return queued is not None

    def _note_plan(self, p: ReaderPass) -> None:
        """Count what an exact epoch's plan repeats or leaves out; log the left-out once."""
        if p.span is None:
            return
        if p.span.pad:
            self._counters.add("planned.padded", p.span.pad)
        if p.span.dropped and p.world.worker == 0:  # the same figure on every reader: once per rank
            self._counters.add("planned.left_out", p.span.dropped)
            if p.world.rank == 0:
                log.info("epoch %d: drop_last leaves out %d samples (fewer than readers x batch size; "
                         "a different set each epoch)", p.epoch, p.span.dropped)

    records_are_tables = False  # records are samples (Arrow formats: tables of rows)
    state_format = STATE_FORMAT  # sd.loader's Loader gathers these states (``checkpoint``)

    def shuffled(self, samples: Iterable[Any], seed: list[int]) -> Iterator[Any]:
        """The pass's shuffle buffer (``shuffle_buffer`` samples; seeded per reader and epoch)."""
        return shuffled(samples, self.shuffle_buffer, random.Random(str(seed)))

    def stages(self, records: Iterator[Any], policy: ErrorPolicy, p: ReaderPass,
               batching: Batching) -> Iterator[Any]:
        """Records -> what the reader yields: prepare, ``map``, shuffle buffer, batches (the
        format's strategy: Arrow formats shuffle and batch tables, tokens pack sequences)."""
        seed = p.seed(self.seed)
        if self.decode_threads > 1:  # decode and map on a pool (formats.images releases the GIL)
            samples = policy.pooled(records, _Prepared(self.prepare, self._map), self.decode_threads,
                                    timeout=DECODE_TIMEOUT)
        else:
            samples = policy.each(records, self.prepare, pull=StageClock.PARSE, run=StageClock.DECODE)
            if self._map is not None:
                samples = policy.each(samples, self._map, run=StageClock.MAP)
        rewind = None if self._live is None else self._live.rewind
        if rewind is not None:  # RESUME-BUFFER: stand-ins for what was delivered before the position
            samples = placeholder_items(samples, rewind.first)
        samples = self.shuffled(samples, seed) if batching.windows is None else blocks.block_shuffled(
            samples, batching.windows)
        if rewind is not None:
            samples = dropped(samples, rewind.delivered)
        if self._live is not None:
            samples = self._live.count(samples)  # counted as delivered (state_dict)
        if batching.batch_size is None:
            return samples
        return batches(samples, batching.batch_size, collate_fn=batching.collate_fn,
                       drop_last=batching.drop_last, in_flight=batching.in_flight, sizes=batching.sizes,
                       left_out=self._left_out)

    def _left_out(self, samples: int) -> None:
        """drop_last left a reader's last short batch out (a split without counts: this rank's readers'
        figure, ``batched.left_out``; an exact epoch's plan has none but after a skip)."""
        self._counters.add("batched.left_out", samples)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.shards)} shards, e.g. {redact_url(self.shards[0].url)!r}, "
                f"shuffle={self.shuffle}, batch_size={self.batch_size})")

