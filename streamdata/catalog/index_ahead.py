"""INDEX-AHEAD: the constructor's sample-index GET sent while the listing is in flight.

``TarDataset(index="auto")`` reads ``_streamdata.sdx`` from the shards' longest common
directory (``index.default_index_url``), or the old name ``streamdata.sdx`` there where only
that exists (``index.find_index``). For the common spec forms that directory is known
before the listing (a brace pattern or a list of names: exactly; a directory prefix ending
in ``/`` or a glob in the last path component: that directory), so the index's GET starts on
a thread of its own before the listing's request and the two round trips overlap. The answer
is used only if the URL worked out from the listed shards is the one fetched ahead; else the
lookup reads the right URL after the listing, as without this module. A spec whose index
location cannot be told before listing (``s3://bkt/name`` without ``/``: a directory or the
start of names) sends nothing ahead.

The two names, at the cost they had with one: where the listing will cover the index's
directory whole (a brace pattern or two or more names in it, a prefix ending in ``/``), it
tells which name exists (``specs.Sightings``), and only the new name's GET is
sent ahead: a dataset without an index costs one 404 beside the listing, as before; one
indexed under the old name only pays one GET after the listing. Where the listing will not
(a glob, a single object, HTTP, ``listing=False``), both GETs are sent ahead together: no
round trip after the listing, one more 404 beside it for a dataset without an index.

Invariant (LIST-ONCE holds): only the process that will make the lookup (rank 0, or the only
process) sends the early GETs; ``from_rank0`` hands the result to the other ranks as before.
The early read has ``read_index``'s bounds (its own retries and deadline); its prefetcher is
closed (its loop thread joined, FORK-AFTER-CLOSE) before the constructor returns or raises.
Under LITE-S3 it is one GET on a plain thread (``LiteS3.get``: no event loop, little CPU
beside the listing's), waited for at most the listing's deadline; anything but a 200 or a
404 is read again by ``read_index``, which retries and reports it. That thread holds no lock
or loop a forked worker could need: if a constructor raises before the lookup, it may run on
until its request's ``timeout``.
"""
from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Mapping
from typing import Any

from streamdata.catalog.index import (
    INDEX_NAMES,
    default_index_url,
    index_entries,
    legacy_index_url,
    open_index,
    read_index,
)
from streamdata.catalog.specs import Sightings, Spec, brace_expand, listing_deadline
from streamdata.config import FetchConfig, lite_http
from streamdata.errors import SpecError, StreamDataError
from streamdata.formats.sdx import ShardEntry, decode_index
from streamdata.store.backends import lite_path, lite_s3
from streamdata.store.urls import Shard, split_url

__all__ = ["IndexAhead", "early_index_url", "listing_tells", "start_index_ahead"]


def _item_urls(item: Any, suffixes: tuple[str, ...]) -> list[str] | None:
    """URLs standing for where ``item``'s shards will be (their directories are what counts);
    ``None`` when that cannot be told without listing."""
    if isinstance(item, Shard):
        return [item.url]
    item = os.fspath(item)
    if not isinstance(item, str) or not item:
        return None
    protocol, path = split_url(item)
    join = (lambda p: p) if protocol == "file" else (lambda p: f"{protocol}://{p}")
    if "{" in path or "}" in path:
        try:
            return [join(p.rstrip("/")) for p in brace_expand(path)]
        except SpecError:
            return None
    if protocol in ("http", "https"):
        return [item]
    head, last = posixpath.split(path)
    if any(c in head for c in "*?["):  # a glob over directories: shards anywhere below
        return None
    if any(c in last for c in "*?[") or path.endswith("/"):  # the directory's objects (or deeper)
        return [join(posixpath.join(head, "x"))]
    if suffixes and last.endswith(suffixes):  # one object
        return [join(path)]
    return None  # a directory or the start of names: the listing tells


def early_index_url(spec: Spec, index: str | None, suffixes: tuple[str, ...] = ()) -> str | None:
    """The index URL the lookup will read, as far as the spec tells before listing; ``None``
    where it does not (or ``index`` is None)."""
    if index is None:
        return None
    if index != "auto":
        return index
    items = [spec] if isinstance(spec, (str, os.PathLike, Shard)) else list(spec)
    urls: list[str] = []
    for item in items:
        found = _item_urls(item, suffixes)
        if not found:
            return None
        urls.extend(found)
    try:
        return default_index_url(urls)
    except SpecError:
        return None


def listing_tells(spec: Spec, url: str, listing: bool = True) -> bool:
    """Whether the listing of ``spec`` will cover ``url``'s directory whole (and so tell which
    of the index's names exists there, ``specs.Sightings``), as far as the spec's form says."""
    if not listing:
        return False
    items = [spec] if isinstance(spec, (str, os.PathLike, Shard)) else list(spec)
    names = [os.fspath(i) for i in items if not isinstance(i, Shard)]
    plain = [n for n in names if isinstance(n, str) and not any(c in n for c in "{}*?[")]
    will = Sightings(INDEX_NAMES)
    for item in names:
        if not isinstance(item, str):
            return False
        protocol, path = split_url(item)
        if protocol in ("http", "https"):
            continue
        head = "" if protocol == "file" else f"{protocol}://"
        if path.endswith("/"):  # listed with all below it
            will.saw(head + path.rstrip("/"), True, ())
        elif "{" in path or len(plain) >= 2 and item in plain:  # their directories, one listing each
            try:
                stated = brace_expand(path)
            except SpecError:
                return False
            for p in stated:
                will.saw(head + posixpath.dirname(p), False, ())
    return will.tells(url.rsplit("/", 1)[0])


class IndexAhead:
    """The index at ``url`` (and at each of ``more``), their GETs sent now; :meth:`read` is
    ``read_index`` for the lookup. Under LITE-S3 a GET is one request of ``LiteS3.get`` on a
    thread of its own (no event loop to start: its CPU would compete with the listing's); else
    the prefetcher's, on its loop thread (either one with ``read`` and ``close``). Always
    :meth:`close` (idempotent)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, config: FetchConfig,
                 more: tuple[str, ...] = ()) -> None:
        self.url = url
        self._early: dict[str, _PrefetcherGet | _LiteGet] = {}
        try:
            for one in (url, *more):
                protocol, path = split_url(one)
                lite = lite_s3(protocol, storage_options) if lite_http() else None
                self._early[one] = (_LiteGet(lite, lite_path(path), config) if lite is not None
                                    else _PrefetcherGet(one, storage_options, config))
        except BaseException:
            self.close()
            raise

    @property
    def urls(self) -> list[str]:
        """The URLs whose answers are still held."""
        return list(self._early)

    def close(self) -> None:
        """Cancel the early GETs whose answers were not taken (a prefetcher's loop thread is
        joined; a LITE-S3 GET's thread ends within its timeout, holding nothing shared)."""
        early, self._early = self._early, {}
        for one in early.values():
            one.close()

    def read(self, url: str, storage_options: Mapping[str, Any] | None = None,
             config: FetchConfig | None = None) -> list[ShardEntry] | None:
        """``read_index(url, ...)``: the early answer when ``url`` is one fetched ahead, else a
        read of ``url`` now (the spec's guess was not where the listing's shards are, or the
        early GET got no plain answer: its errors are reported by that read)."""
        early = self._early.pop(url, None)
        if early is not None:
            return early.read(url, storage_options, config)
        return read_index(url, storage_options, config)


class _PrefetcherGet:
    """The GET through a prefetcher (``index.open_index``), on its loop thread."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, config: FetchConfig) -> None:
        self._fetcher = open_index(url, storage_options, config)

    def read(self, url: str, storage_options: Mapping[str, Any] | None,
             config: FetchConfig | None) -> list[ShardEntry] | None:
        return index_entries(self._fetcher, url)  # bounded as read_index is; closes the fetcher

    def close(self) -> None:
        self._fetcher.close()


class _LiteGet:
    """One LITE-S3 GET (``LiteS3.get``) of ``bucket/key`` on a daemon thread of its own, waited
    for at most the listing's deadline; anything but a 200 or a 404 is read again."""

    def __init__(self, lite: Any, path: str, config: FetchConfig) -> None:
        bucket, _, key = path.partition("/")
        self._limit = listing_deadline(config)
        self._answer: tuple[int, bytes] | None = None
        self._thread = threading.Thread(target=self._get, args=(lite, bucket, key, config.timeout),
                                        name="streamdata-index-ahead", daemon=True)
        self._thread.start()

    def _get(self, lite: Any, bucket: str, key: str, timeout: float) -> None:
        try:
            self._answer = lite.get(bucket, key, timeout=timeout)
        except FileNotFoundError:  # no such object (or bucket: the listing reports that)
            self._answer = (404, b"")
        except Exception:  # the lookup reads it again, and reports what is wrong
            self._answer = None

    def read(self, url: str, storage_options: Mapping[str, Any] | None,
             config: FetchConfig | None) -> list[ShardEntry] | None:
        self._thread.join(self._limit)
        answer = None if self._thread.is_alive() else self._answer
        if answer is not None and answer[0] in (200, 404):
            return None if answer[0] == 404 else decode_index(answer[1], url)
        return read_index(url, storage_options, config)

    def close(self) -> None:
        """Nothing to do: the thread ends within its request's timeout, holding nothing shared."""


def start_index_ahead(spec: Spec, index: str | None, storage_options: Mapping[str, Any] | None,
                      config: FetchConfig, suffixes: tuple[str, ...] = (), *,
                      listing: bool = True) -> IndexAhead | None:
    """An early read of the index the lookup will want, on the process that will look it up
    (rank 0 of a multi-rank job, LIST-ONCE); ``None`` where the spec does not tell where. For
    ``index="auto"``, the old name's GET too where the listing will not tell which exists."""
    from streamdata.ranks import is_rank0

    if not is_rank0():
        return None
    url = early_index_url(spec, index, suffixes)
    if url is None:
        return None
    more = () if index != "auto" or listing_tells(spec, url, listing) else (legacy_index_url(url),)
    try:
        return IndexAhead(url, storage_options, config, more)
    except StreamDataError:  # e.g. an unknown protocol: the listing reports it
        return None
