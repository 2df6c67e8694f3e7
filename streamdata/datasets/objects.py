"""``ObjectDataset``: a map-style dataset of one object per sample, fetched a batch at a time."""

from __future__ import annotations

import functools
import os
import posixpath
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils.data

from streamdata.catalog.specs import Spec, expand_spec
from streamdata.config import OBJECT_MAX_REQUESTS, FetchConfig, stage_times
from streamdata.epoch.state import fingerprint, parse_state, start_state
from streamdata.errors import SpecError
from streamdata.fetch.cache import Cache, cached_object
from streamdata.formats.decode import DecodeSpec, make_decoder
from streamdata.formats.media import MediaTransform
from streamdata.formats.ranged import IN_FLIGHT, READ_AHEAD, RangedFile
from streamdata.formats.seeding import for_pass
from streamdata.metrics import COUNTERS, READER_STATS, Counters, StageClock, decode_timing
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import split_url

__all__ = ["ObjectDataset"]


class ObjectDataset(torch.utils.data.Dataset):
    """A map-style dataset of one object per sample; ``__getitems__`` fetches a batch's objects
    concurrently, so a ``DataLoader(batch_size=32)`` pays about one round trip per batch.

    A sample is ``{"__key__": name without extension, "__url__": url, ext: decoded value}``
    (``__url__`` without its password or signature: ``redact.redact_url``).
    Fetch options (``max_requests``, ``timeout``, ``retry_deadline``, ...) as for the sharded
    datasets; retries are counted per reason in ``retried``, over every worker.

    ``ranged=True`` (with ``decode=`` an ``sd.video`` / ``sd.audio`` transform, or a list
    holding one): the objects it takes are not fetched whole; the transform gets a seekable file
    over ranged GETs of the object (``formats.ranged.RangedFile``), so a clip of a large video
    reads its index and the clip's byte ranges only (docs/media.md). The reads count in the
    reader's ``requests`` and ``bytes``; their waits in its ``decode`` time. A sequential run of
    reads (a clip's frames) fetches ahead by requests sent together, up to ``read_ahead`` bytes
    a round (0: one request at a time).

    ``seed`` and :meth:`set_epoch` seed what ``decode`` and ``map`` draw per sample (an image's
    crop, a video's clip: IMAGE-SEED, ``formats.seeding``), as a sharded dataset's pass does: a
    transform without its own seed draws from ``(seed, epoch, key)``. The epoch lives in shared
    memory, so persistent DataLoader workers see ``set_epoch`` (call it before the epoch's
    first batch, as ``sd.loader``'s ``set_epoch`` is called).
    """

    fetch_defaults = {"max_requests": OBJECT_MAX_REQUESTS}

    def __init__(self, urls: Spec, *, storage_options: dict | None = None, decode: DecodeSpec = True,
                 map: Callable[[Any], Any] | None = None, fetch_config: FetchConfig | None = None,
                 ranged: bool = False, read_ahead: int = READ_AHEAD, seed: int = 0,
                 **fetch_options: Any) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise SpecError(f"seed must be an int, got {seed!r}")
        self.storage_options = dict(storage_options or {})
        self.fetch_config = FetchConfig.resolve(fetch_config, self, defaults=self.fetch_defaults,
                                                **fetch_options)
        # LIST-ONCE: rank 0 lists for every rank
        self.shards = from_rank0(lambda: expand_spec(urls, self.storage_options, config=self.fetch_config))
        self.protocol = split_url(self.shards[0].url)[0]
        self.decode = decode
        self._decoder = make_decoder(decode)
        self.map = map
        self.seed = seed
        # the epoch (``set_epoch``), written by the process that owns the dataset only, read by
        # every worker as a batch starts; the decoder and map bound to it (``_for_epoch``)
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._bound: tuple[int, Any, Any] = (0, for_pass(self._decoder, seed, 0), for_pass(map, seed, 0))
        self.ranged = bool(ranged)
        if not isinstance(read_ahead, int) or read_ahead < 0:
            raise SpecError(f"read_ahead must be an int >= 0 (bytes), got {read_ahead!r}")
        self.read_ahead = read_ahead
        self._ranged_by = _media_transforms(decode) if ranged else ()
        if ranged and not self._ranged_by:
            raise SpecError("ranged=True reads media by ranged requests for a media transform: give "
                            "decode= an sd.video or sd.audio transform (or a list holding one), e.g. "
                            f"decode=sd.video.RandomClip(16), got decode={decode!r}")
        self._counters = Counters(COUNTERS)
        self._stats = Counters(READER_STATS)  # each reader's stage timings (``reader_stats``)
        self._clock: tuple[int, StageClock] | None = None  # this process's (pid, clock)
        self._client: Any = None
        self._cache: Cache | None = None

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
        """Every counter (``retried.*``, ``cache.*``), over every worker."""
        return self._counters.snapshot()

    @property
    def epoch(self) -> int:
        """The epoch the transforms draw for (``set_epoch``; 0 until set)."""
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """Draw the next batches' clips and crops for ``epoch`` (IMAGE-SEED), in every worker."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise SpecError(f"epoch must be an int >= 0, got {epoch!r}")
        self._epoch[0] = epoch

    def _for_epoch(self) -> tuple[Any, Any]:
        """The decoder and ``map`` bound to the current epoch (bound again when it changed)."""
        epoch = int(self._epoch[0])
        if self._bound[0] != epoch:
            self._bound = (epoch, for_pass(self._decoder, self.seed, epoch),
                           for_pass(self.map, self.seed, epoch))
        return self._bound[1], self._bound[2]

    def reader_stats(self) -> list[dict[str, int]]:
        """Each reader's ``metrics.READER_STATS`` so far: a batch's wait for its objects
        (``wait_bytes``), decoding, ``map``; its requests and bytes (``loader.metrics()``)."""
        return self._stats.rows()

    def _stage_clock(self) -> StageClock | None:
        """This process's clock (made again in a forked worker: its wall starts there)."""
        if not stage_times():
            return None
        if self._clock is None or self._clock[0] != os.getpid():
            self._clock = (os.getpid(), StageClock(self._stats))
        return self._clock[1]

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        import asyncio

        client = self._get_client()
        shards = [self.shards[i] for i in indices]
        if self._ranged_by:
            return self._ranged_items(client, shards)
        urls = [s.url for s in shards]
        cache = self._cache

        async def fetch_all() -> list[bytes]:
            sem = asyncio.Semaphore(self.fetch_config.max_requests)

            async def get(url: str) -> bytes:
                async with sem:
                    return await client.get(url)

            async def one(shard: Any) -> bytes:  # from the local cache when there (cache_dir)
                return await cached_object(cache, shard.url, shard.size, getattr(shard, "etag", None),
                                           lambda: get(shard.url))

            return await asyncio.gather(*(one(s) for s in shards))

        cfg = self.fetch_config
        clock = self._stage_clock()
        start = time.perf_counter_ns()
        datas = client.io.run(fetch_all(), cfg.wait_limit(), what="a batch of objects")
        if clock is None:
            return [self._sample(url, data) for url, data in zip(urls, datas, strict=True)]
        fetched = time.perf_counter_ns()
        out = [self._sample(url, data, clock.acc) for url, data in zip(urls, datas, strict=True)]
        now, acc = time.perf_counter_ns(), clock.acc  # the reader's thread only (ONE-WRITER-PER-ROW)
        acc[StageClock.WAIT] += fetched - start
        acc[StageClock.BUSY] += now - start
        acc[StageClock.SAMPLES] += len(out)
        acc[StageClock.BATCHES] += 1
        self._stats.add_many({"requests": len(datas), "bytes": sum(len(d) for d in datas)})
        clock.flush(now)
        return out

    def _takes_ranged(self, url: str) -> bool:
        name = posixpath.basename(split_url(url)[1])
        ext = name.partition(".")[2].lower() or "data"
        return any(t.takes(ext) for t in self._ranged_by)

    def _ranged_items(self, client: Any, shards: Sequence[Any]) -> list[Any]:
        """``ranged=True``: each object a media transform takes is handed over as a
        :class:`RangedFile` (ranged GETs as its decoder reads); any other is fetched whole."""
        cfg = self.fetch_config
        clock = self._stage_clock()
        start = time.perf_counter_ns()
        out, files = [], []
        for shard in shards:
            url = shard.url
            if not self._takes_ranged(url):
                data = client.io.run(client.get(url), cfg.wait_limit(), what=f"object {redact_url(url)}")
                self._stats.add_many({"requests": 1, "bytes": len(data)})
                out.append(self._sample(url, data, None if clock is None else clock.acc))
                continue
            size = shard.size
            if size is None:
                size = client.io.run(client.size(url), cfg.wait_limit(),
                                     what=f"the size of {redact_url(url)}")
            file = RangedFile(functools.partial(self._read_range, client, url), int(size or 0),
                              name=redact_url(url) or "",
                              read_ranges=functools.partial(self._read_ranges, client, url),
                              read_ahead=self.read_ahead, in_flight=min(IN_FLIGHT, cfg.max_requests))
            files.append(file)
            try:
                out.append(self._sample(url, file, None if clock is None else clock.acc))
            finally:
                self._stats.add_many({"requests": file.requests, "bytes": file.bytes_read})
        if clock is not None:
            now, acc = time.perf_counter_ns(), clock.acc
            acc[StageClock.BUSY] += now - start
            acc[StageClock.SAMPLES] += len(out)
            acc[StageClock.BATCHES] += 1
            clock.flush(now)
        return out

    def _read_range(self, client: Any, url: str, start: int, end: int) -> bytes:
        data = client.io.run(client.get(url, start, end), self.fetch_config.wait_limit(),
                             what=f"bytes {start}..{end} of {redact_url(url)}")
        return bytes(data)

    def _read_ranges(self, client: Any, url: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """``ranges`` of the object by requests sent together (a sequential run's read-ahead)."""
        import asyncio

        async def all_of() -> list[Any]:
            return await asyncio.gather(*(client.get(url, start, end) for start, end in ranges))

        datas = client.io.run(all_of(), self.fetch_config.wait_limit(),
                              what=f"bytes {ranges[0][0]}..{ranges[-1][1]} of {redact_url(url)}")
        return [bytes(d) for d in datas]

    def _sample(self, url: str, data: Any, acc: list[int] | None = None) -> Any:
        name = posixpath.basename(split_url(url)[1])
        key, dot, ext = name.partition(".")
        sample = {"__key__": key, "__url__": redact_url(url), (ext.lower() if dot else "data"): data}
        decoder, mapper = self._for_epoch()
        if decoder is not None:
            if acc is None:
                sample = decoder(sample)
            else:
                began, before = time.perf_counter_ns(), decode_timing(acc)  # per modality too
                try:
                    sample = decoder(sample)
                finally:
                    decode_timing(before)
                    acc[StageClock.DECODE] += time.perf_counter_ns() - began
        if mapper is None:
            return sample
        began = time.perf_counter_ns() if acc is not None else 0
        sample = mapper(sample)
        if acc is not None:
            acc[StageClock.MAP] += time.perf_counter_ns() - began
        return sample

    def _get_client(self) -> Any:
        from streamdata.store.client import AsyncClient

        if self._client is None or self._client.io.inherited:  # forked: FORK-RESET closed it
            self._client = AsyncClient(self.protocol, self.storage_options, self.fetch_config,
                                       counters=self._counters,
                                       name="objects", url=self.shards[0].url)
            cfg = self.fetch_config
            self._cache = Cache(cfg.cache_dir, cfg.cache_limit, self._counters) if cfg.cache_dir else None
        return self._client

    # ---- the state (``state``; docs/resume.md) ------------------------------------------

    def state_dict(self) -> dict:
        """The state protocol's record for a map-style dataset: no position of its own (which
        indices come next is the sampler's, saved by ``StatefulDataLoader``), only what ties a
        checkpoint to this dataset (its objects and sizes), so another dataset's is refused."""
        return start_state(self._fingerprint, 0, "objects")

    def load_state_dict(self, state: dict) -> None:
        """Check that ``state`` was saved from this dataset (SpecError if not); nothing to seek."""
        parse_state(state, self._fingerprint, "objects")

    @functools.cached_property
    def _fingerprint(self) -> str:
        """Worked out once (the objects are fixed): StatefulDataLoader's workers ask for the
        state after every batch, and the digest reads every object's URL and size."""
        return fingerprint(self.shards, None, seed=0, shuffle=False)

    def close(self) -> None:
        """Close this process's connections and I/O thread (workers close theirs at exit)."""
        client, self._client = self._client, None
        if client is not None and not client.io.inherited:
            client.close()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_client"] = None  # never inherit a loop (LOOP-AFTER-FORK)
        state["_cache"] = None  # made again with the client, in the process that reads
        state["_clock"] = None  # its wall starts in the process that reads
        return state


def _media_transforms(decode: Any) -> tuple[MediaTransform, ...]:
    """The media transforms of a ``decode=`` spec (one, or those in a list)."""
    items = decode if isinstance(decode, (list, tuple)) else [decode]
    return tuple(t for t in items if isinstance(t, MediaTransform))
