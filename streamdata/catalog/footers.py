"""What the constructors of the Parquet and Arrow datasets read once (LIST-ONCE, on rank 0):
object sizes the listing lacked, every object's footer (one tail each), and the message headers
of Arrow IPC files' record batches (their row counts), all through one ``Prefetcher`` each."""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Mapping, Sequence

from streamdata.catalog.specs import listing_deadline
from streamdata.config import FetchConfig
from streamdata.errors import FormatError, StreamDataError
from streamdata.fetch.prefetcher import FetchItem, Prefetcher
from streamdata.formats import arrow as fmt
from streamdata.policy import ErrorPolicy
from streamdata.store.urls import Shard, known_size, split_url

__all__ = ["read_batch_rows", "read_footers", "with_sizes"]

KiB = 1024
_FOOTER_WINDOW = 64  # objects whose tails are in flight at once while reading footers
_HEADER_GAP = 16 * KiB  # IPC batch headers this close are fetched as one range (with the body between)


# ---- footers: tails of every object, through the fetcher ------------------------------------


def with_sizes(shards: list[Shard], storage_options: dict, config: FetchConfig) -> list[Shard]:
    """Shards whose listing gave no size (HTTP) get one from a HEAD, all at once."""
    missing = [s for s in shards if s.size is None]
    if not missing:
        return shards
    from streamdata.store.client import AsyncClient

    # the constructor's bound, not a part's (urls.listing_deadline); sizes only: each probe asks
    # for one byte, as the first would otherwise bring first_part bytes (HEAD-START) for a
    # reader that is not here (this client closes below)
    config = config.replace(retry_deadline=listing_deadline(config), first_part=1)
    client = AsyncClient(split_url(missing[0].url)[0], storage_options, config, name="sizes")
    try:
        async def sizes() -> list[int | None]:
            return await asyncio.gather(*(client.size(s.url) for s in missing))

        found = dict(zip([s.url for s in missing],
                         client.io.run(sizes(), config.timeout * 2 + 30, what="object sizes"), strict=True))
    finally:
        client.close()  # FORK-AFTER-CLOSE: its threads are gone before workers fork
    return [s if s.size is not None else Shard(s.url, found[s.url]) for s in shards]


def _fetch(requests: Sequence[tuple[Shard, tuple[fmt.Range, ...]]], storage_options: dict,
           config: FetchConfig) -> list[tuple[Shard, list[bytes] | StreamDataError]]:
    """The bytes of each request's ranges (or the error that prevented them), in order.

    Runs in the process that builds the dataset, just before DataLoader workers fork: see
    FORK-AFTER-CLOSE in ``store.loop``.
    """
    if not requests:
        return []
    items = [FetchItem(s.url, s.size, ranges, getattr(s, "etag", None)) for s, ranges in requests]
    cfg = config.replace(window=max(config.window, _FOOTER_WINDOW))
    out: list[tuple[Shard, list[bytes] | StreamDataError]] = []
    with Prefetcher(items, storage_options, cfg, where="footers") as fetcher:
        for (shard, _), reader in zip(requests, fetcher, strict=True):
            try:
                out.append((shard, reader.read_ranges()))
            except StreamDataError as exc:
                out.append((shard, exc))
    return out



def read_footers(shards: Sequence[Shard], storage_options: dict, config: FetchConfig, *,
                 tail_bytes: int, footer_length: Callable[[bytes, Shard], int],
                 policy: ErrorPolicy) -> dict[str, bytes]:
    """``{url: footer bytes}``: one tail per object, a second read only for a footer larger than
    ``tail_bytes``.  ``footer_length(tail, shard)`` says how many final bytes the footer needs."""
    footers: dict[str, bytes] = {}
    again: list[tuple[Shard, tuple[fmt.Range, ...]]] = []

    def take(shard: Shard, data: list[bytes] | StreamDataError, second: bool) -> None:
        try:
            if isinstance(data, StreamDataError):
                raise data
            tail = data[-1]
            need = footer_length(tail, shard)
            if need <= len(tail):
                footers[shard.url] = tail[len(tail) - need:]
            elif second:
                raise FormatError(f"corrupt footer in {shard.url}", url=shard.url, key="footer")
            else:
                size = known_size(shard)
                again.append((shard, ((size - need, size),)))
        except StreamDataError as exc:
            policy.check(exc)

    first = [(s, ((max(0, known_size(s) - tail_bytes), known_size(s)),)) for s in shards]
    for shard, data in _fetch(first, storage_options, config):
        take(shard, data, False)
    for shard, data in _fetch(list(again), storage_options, config):
        take(shard, data, True)
    return footers


def read_batch_rows(shards: Sequence[Shard], footers: Mapping[str, bytes], storage_options: dict,
                    config: FetchConfig, policy: ErrorPolicy) -> dict[str, list[int] | None]:
    """``{url: rows of each record batch}`` of Arrow IPC files, from the batches' message
    headers: one item per file (its headers' ranges coalesced), all files in parallel.  None:
    a count past any plausible size (more rows than body bits + 64 Ki, e.g. a corrupt header, or
    a batch of null columns) is not trusted.  An unreadable file is left out per ``policy``."""
    wanted = {s.url: fmt.ipc_batch_meta_ranges(footers[s.url], s.url, known_size(s)) for s in shards}
    requests = [(s, tuple(fmt.coalesce([r for r, _ in wanted[s.url]], _HEADER_GAP)))
                for s in shards if wanted[s.url]]
    out: dict[str, list[int] | None] = {url: [] for url, ranges in wanted.items() if not ranges}
    for (shard, ranges), (_, data) in zip(requests, _fetch(requests, storage_options, config), strict=True):
        try:
            if isinstance(data, StreamDataError):
                raise data
            rows: list[int] | None = []
            starts = [a for a, _ in ranges]
            for k, ((start, end), body) in enumerate(wanted[shard.url]):
                i = bisect.bisect_right(starts, start) - 1
                n = fmt.ipc_batch_rows(data[i][start - ranges[i][0]:end - ranges[i][0]], shard.url, k)
                rows = None if rows is None or n > 8 * body + 65536 else [*rows, n]
            out[shard.url] = rows
        except StreamDataError as exc:
            policy.check(exc)
    return out
