"""The sharded datasets' one pass: spec -> plan -> prefetcher -> records -> map -> shuffle -> batch.

:class:`ShardedDataset` owns the epoch pass for every format: the reader's world, its plan
of units for the epoch, the prefetcher, the error policy, ``map``, the shuffle, batching and
the epoch iterator. A format supplies only what a unit is and how a fetched unit becomes
records (``fetch_item`` and ``read_unit``); :class:`TarDataset` is that for tar shards, and
:mod:`streamdata.parquet` for Parquet row groups and Arrow record batches (whose records are
Arrow tables, shuffled and batched at table level by ``table_stages``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch.utils.data

from .config import FetchConfig
from .decode import DecodeSpec, make_decoder
from .errors import SpecError, StreamDataError
from .fetch import FetchItem, ItemReader, Prefetcher
from .formats.compress import TAR_SUFFIXES, decompressed
from .formats.tar import samples_from_chunks
from .incremental import batches
from .metrics import COUNTERS, Counters
from .policy import ErrorPolicy, OnError
from .ranks import from_rank0
from .redact import redact_url
from .sharding import assign, reader_seed
from .stages import shuffled
from .urls import Shard, Spec, expand_spec
from .world import World

__all__ = ["EpochIterator", "ReaderPass", "ShardedDataset", "TarDataset"]

DEFAULT_SHUFFLE_BUFFER = 512  # samples, per reader, with shuffle=True


class EpochIterator:
    """One reader's pass over its share of an epoch; creating it starts the fetch.

    Closing it (explicitly, at exhaustion, on error, or when garbage-collected after an
    early ``break``) closes the prefetcher: no thread, task or connection is left behind.
    """

    def __init__(self, items: Iterator[Any], close: Callable[[], None]) -> None:
        self._items = items
        self._close: Callable[[], None] | None = close

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self._close is None:
            raise StopIteration
        try:
            return next(self._items)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            getattr(self._items, "close", lambda: None)()
            close()

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class ReaderPass:
    """What one reader reads in one pass: where it stands, the epoch, its units in order.

    A pass is a pure function of the dataset's units, ``(seed, epoch)`` and the world
    (EXACTLY-ONCE, see ``sharding``), so a saved position in it is all a resume needs.
    """

    world: World
    epoch: int
    units: list[Any]

    def seed(self, seed: int) -> list[int]:
        """Seed material for this reader's shuffle in this pass."""
        return reader_seed(self.world, seed=seed, epoch=self.epoch)


class ShardedDataset(torch.utils.data.IterableDataset):
    """The pass every sharded dataset shares; subclasses say what a unit is and read it.

    The spec is expanded (and validated) here, in the constructing process, before any
    worker starts. Each ``iter()`` reads this reader's share of the epoch. Fetch options
    (``window``, ``part_size``, ``max_requests``, ``byte_budget``, ``timeout``,
    ``retry_deadline``, ``retries``, ``backoff``, ``backoff_cap``, ...) are given flat or as
    ``fetch_config=`` (:meth:`FetchConfig.resolve`). Skips under ``on_error`` and retries are
    counted in :attr:`skipped` and :attr:`retried`, over every worker.
    """

    suffixes: tuple[str, ...] = ()
    fetch_defaults: dict[str, Any] = {}  # a format's own defaults (FetchConfig.resolve)
    default_shuffle_buffer = DEFAULT_SHUFFLE_BUFFER

    def __init__(self, spec: Spec, *, storage_options: dict | None = None, shuffle: bool = False,
                 seed: int = 0, shuffle_buffer: int | None = None, batch_size: int | None = None,
                 drop_last: bool = False, collate_fn: Callable[[list], Any] | None = None,
                 map: Callable[[Any], Any] | None = None, on_error: OnError = "raise",
                 fetch_config: FetchConfig | None = None, **fetch_options: Any) -> None:
        super().__init__()
        if batch_size is not None and batch_size < 1:
            raise SpecError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.fetch_config = FetchConfig.resolve(fetch_config, defaults=self.fetch_defaults, **fetch_options)
        self.on_error = ErrorPolicy.validate(on_error)  # in the main process, before any worker
        self.storage_options = dict(storage_options or {})
        # one listing per job: rank 0 expands the spec for every rank (LIST-ONCE)
        self.shards: list[Shard] = from_rank0(lambda: expand_spec(
            spec, self.storage_options, suffixes=self.suffixes, config=self.fetch_config))
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = ((self.default_shuffle_buffer if shuffle else 0) if shuffle_buffer is None
                               else shuffle_buffer)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn  # None: each sample into a shared-memory batch as it comes
        self.map = map
        self._counters = Counters(COUNTERS)
        self._epoch = 0
        self._passes = 0

    # ---- epochs and counts ------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle to read next (call before each epoch, as with
        ``DistributedSampler``).  A persistent worker's copy of the dataset cannot see this
        call, so inside a DataLoader worker the epoch also advances by one per pass: calling
        ``set_epoch(0), set_epoch(1), ...`` gives the same orders with or without persistence."""
        self._epoch = int(epoch)
        self._passes = 0

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
    def counts(self) -> dict[str, int]:
        """Every counter (``skipped.*``, ``retried.*``, ``accepted.*``), over every worker."""
        return self._counters.snapshot()

    # ---- what a format supplies --------------------------------------------------------

    def units(self) -> Sequence[Any]:
        """The work units split across readers (shards here; row groups for Parquet)."""
        return self.shards

    def fetch_item(self, unit: Any) -> FetchItem:
        """What to fetch for ``unit``: its object, whole or as byte ranges."""
        return FetchItem(unit.url, unit.size)

    def read_unit(self, unit: Any, reader: ItemReader) -> Iterable[Any]:
        """A fetched unit's records, in order."""
        raise NotImplementedError

    def prepare(self, record: Any) -> Any:
        """One record made ready for the shuffle and the batch (decoding); errors are
        handled by the policy, per record."""
        return record

    # ---- the pass -----------------------------------------------------------------------

    def reader_pass(self) -> ReaderPass:
        """This reader's pass of the current epoch (and, in a worker, one pass counted)."""
        world = World.current()
        epoch = self.epoch
        if torch.utils.data.get_worker_info() is not None:
            self._passes += 1  # a persistent worker's copy cannot see set_epoch: count passes
        units = assign(self.units(), world, seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return ReaderPass(world, epoch, units)

    def __iter__(self) -> Iterator[Any]:
        p = self.reader_pass()
        where = p.world.describe()
        policy = ErrorPolicy(self.on_error, self._counters, where=where)
        units, items = [], []
        for unit in p.units:  # a unit whose byte ranges cannot be worked out is a bad unit
            try:
                items.append(self.fetch_item(unit))
            except StreamDataError as exc:
                policy.check(exc)
                continue
            units.append(unit)
        fetcher = Prefetcher(items, self.storage_options, self.fetch_config, where=where,
                             counters=self._counters)
        records = policy.units(self.read_unit(u, r) for u, r in zip(units, fetcher, strict=True))
        return EpochIterator(self.stages(records, policy, p.seed(self.seed)), fetcher.close)

    def stages(self, records: Iterator[Any], policy: ErrorPolicy, seed: list[int]) -> Iterator[Any]:
        """Records -> what the reader yields: prepare, ``map``, shuffle buffer, batches."""
        samples = policy.each(records, self.prepare)
        if self.map is not None:
            samples = policy.each(samples, self.map)
        samples = shuffled(samples, self.shuffle_buffer, random.Random(str(seed)))
        if self.batch_size is None:
            return samples
        return batches(samples, self.batch_size, collate_fn=self.collate_fn, drop_last=self.drop_last)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.shards)} shards, e.g. {redact_url(self.shards[0].url)!r}, "
                f"shuffle={self.shuffle}, batch_size={self.batch_size})")


class TarDataset(ShardedDataset):
    """WebDataset-layout tar shards from any fsspec URL, split exactly across ranks and workers.

    Yields decoded sample dicts (``__key__``, ``__url__`` and one entry per extension), or,
    with ``batch_size``, collated batches built inside the worker.  See the README for options.
    """

    suffixes = TAR_SUFFIXES

    def __init__(self, spec: Spec, *, decode: DecodeSpec = True, accept_unterminated: bool = False,
                 **options: Any) -> None:
        self.decode = decode
        self.accept_unterminated = accept_unterminated  # read shards without the end marker
        self._decoder = make_decoder(decode)
        super().__init__(spec, **options)

    def read_unit(self, unit: Shard, reader: ItemReader) -> Iterator[dict]:
        # samples' __url__ (and the parser's errors) name the shard without its secrets,
        # redacted once per shard; the real URL is in self.shards
        chunks, compressed = decompressed(reader.chunks(), redact_url(reader.url))
        yield from samples_from_chunks(
            chunks, redact_url(reader.url), total=None if compressed else unit.size,
            accept_unterminated=self.accept_unterminated,
            on_unterminated=lambda: self._counters.add("accepted.unterminated"))

    def prepare(self, record: dict) -> dict:
        return record if self._decoder is None else self._decoder(record)
