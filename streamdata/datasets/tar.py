"""Tar shards (WebDataset layout) as a sharded dataset: a shard's bytes -> samples.

The pass is :class:`~streamdata.datasets.sharded.ShardedDataset`'s; this module says what a tar unit
is and how it is read: whole shards, or, with a sample index (:mod:`streamdata.catalog.index`),
spans of samples read with ranged GETs from the index's offsets (an exact epoch, ``plan``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from streamdata.catalog.index import INDEX_NAMES, IndexedShards, lookup
from streamdata.catalog.index_ahead import IndexAhead, start_index_ahead
from streamdata.catalog.specs import Sightings, Spec
from streamdata.datasets.passes import stale_count
from streamdata.datasets.sharded import ShardedDataset
from streamdata.fetch.prefetcher import FetchItem, ItemReader
from streamdata.formats.compress import TAR_SUFFIXES, decompressed
from streamdata.formats.decode import DecodeSpec, make_decoder
from streamdata.formats.seeding import for_pass
from streamdata.formats.tar import samples_from_chunks
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard

__all__ = ["TarDataset"]

log = logging.getLogger("streamdata")


class TarDataset(ShardedDataset):
    """WebDataset-layout tar shards from any fsspec URL, split exactly across ranks and workers.

    Yields decoded sample dicts (``__key__``, ``__url__`` and one entry per extension), or,
    with ``batch_size``, collated batches built inside the worker.  With a sample index
    (``index="auto"``: ``_streamdata.sdx`` beside the shards, or the older ``streamdata.sdx``,
    if there is one; a URL: that index; None: never) every epoch is exact: equal spans of
    samples per reader, read with ranged GETs from the samples' offsets, and the same number of
    batches on every rank (EQUAL-STEPS, ``plan``).  Without one, shards are split whole.  See
    the README for options.
    """

    suffixes = TAR_SUFFIXES

    def __init__(self, spec: Spec, *, decode: DecodeSpec = True, accept_unterminated: bool = False,
                 index: str | None = "auto", **options: Any) -> None:
        self.decode = decode
        self.accept_unterminated = accept_unterminated  # read shards without the end marker
        # before any request: a bad decode spec is refused before the listing
        self._decoder: Callable[[dict], dict] | None = make_decoder(decode)
        self._pass_decoder = self._decoder  # bound to the current pass (``start_pass``)
        self.index = index
        self._ahead: IndexAhead | None = None
        self._sightings: Sightings | None = None
        try:
            super().__init__(spec, **options)
            ahead = self._ahead  # INDEX-AHEAD: its GET went out while the spec was listed
            # LIST-ONCE: rank 0 reads the index (one GET) and hands it to every rank
            self._index: IndexedShards | None = None if index is None else from_rank0(
                lambda: lookup(self.shards, index, self.storage_options, self.fetch_config,
                               read=None if ahead is None else ahead.read, sightings=self._sightings))
        finally:
            if self._ahead is not None:
                self._ahead.close()
                self._ahead = None
        self._offsets = {} if self._index is None else dict(
            zip((s.url for s in self.shards), self._index.offsets, strict=True))
        self.block_window()  # shuffle="block" without sample counts: SpecError here, not in a worker
        world = self.world()
        if self._index is None and world.world_size > 1 and world.rank == 0:
            log.warning("%d tar shards and no sample index: each epoch is split by shard, so ranks can "
                        "get unequal numbers of batches (sd.loader ends the epoch on every rank together; "
                        "a plain DataLoader needs torch.distributed.algorithms.join.Join). For exact "
                        "epochs, build the index once: streamdata index SPEC", len(self.shards))

    def before_listing(self, spec: Spec, listing: bool) -> Sightings | None:
        self._ahead = start_index_ahead(spec, self.index, self.storage_options, self.fetch_config,
                                        self.suffixes, listing=listing)
        # which of the index's names the listing saw tells which one to read
        self._sightings = Sightings(INDEX_NAMES) if self.index == "auto" else None
        return self._sightings

    def sample_counts(self) -> np.ndarray | None:
        return None if self._index is None else self._index.counts

    def read_unit(self, unit: Shard, reader: ItemReader) -> Iterator[dict]:
        # samples' __url__ (and the parser's errors) name the shard without its secrets,
        # redacted once per shard; the real URL is in self.shards
        shown = redact_url(reader.url) or reader.url
        chunks, compressed = decompressed(reader.chunks(), shown)
        yield from samples_from_chunks(
            chunks, shown, total=None if compressed else unit.size,
            accept_unterminated=self.accept_unterminated,
            on_unterminated=lambda: self._counters.add("accepted.unterminated"))

    def ranged_segments(self) -> bool:
        """With the index's offsets a span's samples are one ranged GET (the block shuffle's windows)."""
        return bool(self._offsets) and all(o is not None for o in self._offsets.values())

    def fetch_segment(self, unit: Shard, start: int, stop: int, count: int) -> FetchItem:
        """The bytes of samples ``[start, stop)`` from the index's offsets (to the object's end,
        marker included, for a span that ends with the shard); a whole shard as one object."""
        offsets = self._offsets.get(unit.url)
        if offsets is None or start == 0 and stop == count:  # whole, or counts without offsets
            return self.fetch_item(unit)
        end = unit.size if stop == count else int(offsets[stop])
        return FetchItem(unit.url, unit.size, ((int(offsets[start]), end),), self.etag(unit.url))

    def read_segment(self, unit: Shard, start: int, stop: int, count: int,
                     reader: ItemReader) -> Iterator[dict]:
        """Samples ``[start, stop)``: the fetched range parsed as it is (checked to hold exactly
        those samples), or, without offsets, the shard read from its start."""
        if reader.item.ranges is None:  # the whole shard (or no offsets): read from its start
            yield from super().read_segment(unit, start, stop, count, reader)
            return
        (first, end), = reader.item.ranges
        to_end = stop == count  # the range ends with the shard's end-of-archive marker
        samples = samples_from_chunks(
            reader.chunks(), redact_url(reader.url) or reader.url, total=None if end is None else end - first,
            accept_unterminated=self.accept_unterminated or not to_end,
            on_unterminated=(lambda: self._counters.add("accepted.unterminated")) if to_end else None)
        seen = 0
        for seen, sample in enumerate(samples, 1):
            if seen > stop - start:
                raise stale_count(reader.url, start + seen, stop)  # more than the index says
            yield sample
        if seen != stop - start:
            raise stale_count(reader.url, start + seen, stop)

    def start_pass(self, epoch: int) -> None:
        super().start_pass(epoch)
        self._pass_decoder = for_pass(self._decoder, self.seed, epoch)  # IMAGE-SEED

    def prepare(self, record: dict) -> dict:
        return record if self._pass_decoder is None else self._pass_decoder(record)
