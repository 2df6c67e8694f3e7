"""The public datasets: wiring of spec -> sharding -> fetch -> format -> decode -> batch."""

from __future__ import annotations

import posixpath
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.utils.data

from .config import FetchConfig
from .decode import DecodeSpec, make_decoder
from .errors import StreamDataError
from .fetch import Prefetcher
from .formats.tar import samples_from_chunks
from .sharding import assign, reader_seed
from .stages import ErrorPolicy, batched, shuffled
from .urls import Shard, Spec, expand_spec, split_url
from .world import World

__all__ = ["ObjectDataset", "ShardedDataset", "TarDataset"]

def _fetch_config(config: FetchConfig | None, overrides: dict[str, Any]) -> FetchConfig:
    base = config or FetchConfig.from_env()
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})


def _default_collate(batch: list) -> Any:
    from .collate import collate  # shared-memory tensors built in the worker, /dev/shm checked

    return collate(batch)


class _EpochIterator:
    """One reader's pass over its share of an epoch; creating it starts the fetch.

    Closing it (explicitly, at exhaustion, on error, or when garbage-collected after an
    early ``break``) closes the prefetcher: no thread, task or connection is left behind.
    """

    def __init__(self, items: Iterator[Any], close: Callable[[], None]) -> None:
        self._items = items
        self._close: Callable[[], None] | None = close

    def __iter__(self) -> _EpochIterator:
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


class ShardedDataset(torch.utils.data.IterableDataset):
    """Shared machinery of the sharded datasets; subclasses turn fetched units into samples.

    The spec is expanded (and validated) here, in the constructing process, before any
    worker starts.  Each ``iter()`` reads this reader's share of the epoch: units are
    assigned by ``sharding.assign`` from ``(seed, epoch)``, so every sample of an epoch is
    read exactly once across all ranks and workers.
    """

    suffixes: tuple[str, ...] = ()

    def __init__(self, spec: Spec, *, storage_options: dict | None = None, shuffle: bool = False,
                 seed: int = 0, shuffle_buffer: int | None = None, batch_size: int | None = None,
                 drop_last: bool = False, collate_fn: Callable[[list], Any] | None = None,
                 map: Callable[[Any], Any] | None = None, on_error: str | Callable = "raise",
                 fetch_config: FetchConfig | None = None, window: int | None = None,
                 part_size: int | None = None, max_requests: int | None = None,
                 byte_budget: int | None = None, retries: int | None = None,
                 backoff: float | None = None, timeout: float | None = None) -> None:
        super().__init__()
        from .errors import SpecError

        if batch_size is not None and batch_size < 1:
            raise SpecError(f"batch_size must be >= 1 or None, got {batch_size}")
        self.storage_options = dict(storage_options or {})
        self.shards: list[Shard] = expand_spec(spec, self.storage_options, suffixes=self.suffixes)
        self.shuffle = shuffle
        self.seed = seed
        self.shuffle_buffer = (512 if shuffle else 0) if shuffle_buffer is None else shuffle_buffer
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn or _default_collate
        self.map = map
        ErrorPolicy(on_error)  # validate now, in the main process
        self.on_error = on_error
        self.fetch_config = _fetch_config(fetch_config, dict(
            window=window, part_size=part_size, max_requests=max_requests, byte_budget=byte_budget,
            retries=retries, backoff=backoff, timeout=timeout))
        self._epoch = 0
        self._passes = 0

    # ---- epochs -----------------------------------------------------------------------

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

    # ---- iteration --------------------------------------------------------------------

    def units(self) -> Sequence[Any]:
        """The work units split across readers (shards here; row groups for Parquet)."""
        return self.shards

    def _begin_pass(self) -> tuple[World, int, list[Any]]:
        """This reader's world, the epoch of this pass, and its units in reading order."""
        world = World.current()
        epoch = self.epoch
        if torch.utils.data.get_worker_info() is not None:
            self._passes += 1  # a persistent worker's copy cannot see set_epoch: count passes
        return world, epoch, assign(self.units(), world, seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    def __iter__(self) -> Iterator[Any]:
        world, epoch, mine = self._begin_pass()
        policy = ErrorPolicy(self.on_error)
        fetcher = self._prefetcher(mine, world)
        samples = self._samples(fetcher, mine, policy)
        if self.map is not None:
            samples = (self.map(s) for s in samples)
        rng = random.Random(str(reader_seed(world, seed=self.seed, epoch=epoch)))
        samples = shuffled(samples, self.shuffle_buffer, rng)
        if self.batch_size is not None and self.collate_fn is _default_collate:
            from .incremental import batched_incrementally  # each sample into the batch as it comes

            samples = batched_incrementally(samples, self.batch_size, self.drop_last)
        elif self.batch_size is not None:
            samples = batched(samples, self.batch_size, self.collate_fn, self.drop_last)
        return _EpochIterator(samples, fetcher.close)

    def _prefetcher(self, mine: Sequence[Any], world: World) -> Prefetcher:
        return Prefetcher(mine, self.storage_options, self.fetch_config, where=world.describe())

    def _samples(self, fetcher: Prefetcher, mine: Sequence[Any], policy: ErrorPolicy) -> Iterator[Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.shards)} shards, e.g. {self.shards[0].url!r}, "
                f"shuffle={self.shuffle}, batch_size={self.batch_size})")


class TarDataset(ShardedDataset):
    """WebDataset-layout tar shards from any fsspec URL, split exactly across ranks and workers.

    Yields decoded sample dicts (``__key__``, ``__url__`` and one entry per extension), or,
    with ``batch_size``, collated batches built inside the worker.  See the README for options.
    """

    suffixes = (".tar",)

    def __init__(self, spec: Spec, *, decode: DecodeSpec = True, **options: Any) -> None:
        super().__init__(spec, **options)
        self.decode = decode
        self._decoder = make_decoder(decode)

    def _samples(self, fetcher: Prefetcher, mine: Sequence[Any], policy: ErrorPolicy) -> Iterator[dict]:
        decoder = self._decoder
        for reader in fetcher:
            try:
                for raw in samples_from_chunks(reader.chunks(), reader.url):
                    if decoder is None:
                        yield raw
                        continue
                    try:
                        sample = decoder(raw)
                    except StreamDataError as exc:
                        if not policy.skip(exc):
                            raise
                        continue
                    yield sample
            except StreamDataError as exc:
                if not policy.skip(exc):
                    if not exc.where:
                        exc.where = fetcher.where
                    raise


class ObjectDataset(torch.utils.data.Dataset):
    """A map-style dataset of one object per sample; ``__getitems__`` fetches a batch's objects
    concurrently, so a ``DataLoader(batch_size=32)`` pays about one round trip per batch.

    A sample is ``{"__key__": name without extension, "__url__": url, ext: decoded value}``.
    """

    def __init__(self, urls: Spec, *, storage_options: dict | None = None, decode: DecodeSpec = True,
                 map: Callable[[Any], Any] | None = None, fetch_config: FetchConfig | None = None,
                 max_requests: int | None = None, retries: int | None = None,
                 timeout: float | None = None) -> None:
        self.storage_options = dict(storage_options or {})
        self.shards = expand_spec(urls, self.storage_options)
        self.protocol = split_url(self.shards[0].url)[0]
        self.decode = decode
        self._decoder = make_decoder(decode)
        self.map = map
        self.fetch_config = _fetch_config(fetch_config, dict(
            max_requests=max_requests or 64, retries=retries, timeout=timeout))
        self._client: Any = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        import asyncio

        client = self._get_client()
        urls = [self.shards[i].url for i in indices]

        async def fetch_all() -> list[bytes]:
            sem = asyncio.Semaphore(self.fetch_config.max_requests)

            async def one(url: str) -> bytes:
                async with sem:
                    return await client.get(url)

            return await asyncio.gather(*(one(u) for u in urls))

        cfg = self.fetch_config
        datas = client.io.run(fetch_all(), cfg.timeout * (cfg.retries + 1) + 30, what="a batch of objects")
        return [self._sample(url, data) for url, data in zip(urls, datas)]

    def _sample(self, url: str, data: bytes) -> Any:
        name = posixpath.basename(split_url(url)[1])
        key, dot, ext = name.partition(".")
        sample = {"__key__": key, "__url__": url, (ext.lower() if dot else "data"): data}
        if self._decoder is not None:
            sample = self._decoder(sample)
        return self.map(sample) if self.map is not None else sample

    def _get_client(self) -> Any:
        import os

        from .client import AsyncClient

        if self._client is None or self._pid != os.getpid():
            self._client = AsyncClient(self.protocol, self.storage_options, self.fetch_config,
                                       name="objects", url=self.shards[0].url)
            self._pid = os.getpid()
        return self._client

    def close(self) -> None:
        """Close this process's connections and I/O thread (workers close theirs at exit)."""
        if self._client is not None and self._pid is not None:
            import os

            if self._pid == os.getpid():
                self._client.close()
            self._client = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_client"], state["_pid"] = None, None  # never inherit a loop (LOOP-AFTER-FORK)
        return state
