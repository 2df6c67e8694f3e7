"""The sample index: per tar shard, its sample count and each sample's byte offset.

One index object per directory of shards, ``<directory>/_streamdata.sdx`` (:data:`INDEX_NAME`;
for shards in several directories, their longest common directory). Its name starts with
``_`` so that tools reading a folder's files as shards skip it as they skip ``_SUCCESS`` (Ray
Data, pyarrow datasets, Spark, Hadoop). Every writer writes that name; ``index="auto"`` still
reads the old name :data:`LEGACY_INDEX_NAME` where the new one is absent, and the new one
wins where both exist (:func:`find_index`). Its entries are keyed by
the shard's URL relative to that directory (the absolute URL for a shard outside it), so a
copied bucket keeps a working index. The bytes (format v1, checksummed; or a wids shard-list
JSON, counts only) are ``formats.sdx``'s.

An entry is *stale* when its shard's size, or its ETag where both are known, differs from the
listing: :func:`lookup` refuses it (``StaleIndexError``) rather than read the wrong bytes.
:func:`build_index` reads every shard through the prefetcher, saves what it has every few
seconds and at the end, and on a second run reads only the shards without a fresh entry.
Compressed shards (``.tar.gz``, ``.tgz``, ``.tar.zst``) get no entry: a ranged read cannot
start inside a compressed stream.
"""

from __future__ import annotations

import contextlib
import posixpath
import re
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamdata.catalog.specs import Sightings, Spec, expand_spec, listing_deadline
from streamdata.config import FetchConfig
from streamdata.errors import (
    AccessDeniedError,
    CertificateError,
    ProxyAuthError,
    ShardFetchError,
    ShardNotFoundError,
    SpecError,
    StaleIndexError,
    StreamDataError,
)
from streamdata.fetch.prefetcher import FetchItem, Prefetcher
from streamdata.formats.sdx import REBUILD, ShardEntry, decode_index, encode_index, tar_sample_offsets
from streamdata.progress import progress as _progress
from streamdata.redact import redact_url
from streamdata.store.backends import call_with_deadline, close_filesystem, filesystem, translate_error
from streamdata.store.urls import Shard, split_url

__all__ = ["INDEX_NAME", "INDEX_NAMES", "LEGACY_INDEX_NAME", "IndexedShards", "ShardEntry", "build_index",
           "decode_index", "default_index_url", "encode_index", "entry_name", "find_index", "index_entries",
           "index_status", "legacy_index_url", "lookup", "open_index", "read_index", "tar_sample_offsets",
           "write_index", "write_object"]

INDEX_NAME = "_streamdata.sdx"  # "_": skipped by other tools' reads of the folder
LEGACY_INDEX_NAME = "streamdata.sdx"  # the name before: read, never written
INDEX_NAMES = (INDEX_NAME, LEGACY_INDEX_NAME)


@dataclass(frozen=True, eq=False)
class IndexedShards:
    """What :func:`lookup` found: the index's URL, sample counts aligned with the shards,
    and each shard's offsets (``None`` where the index has counts only)."""

    url: str
    counts: np.ndarray
    offsets: list[np.ndarray | None]


# ---------------------------------------------------------------------------- locations


def default_index_url(urls: Sequence[str]) -> str:
    """``<longest common directory of urls>/_streamdata.sdx``; ``SpecError`` when the shards
    share no directory (several buckets or protocols) or are signed HTTP URLs."""
    if not urls:
        raise SpecError("no shards: an index location needs at least one shard URL")
    if any("?" in u for u in urls if split_url(u)[0] in ("http", "https")):
        raise SpecError("shards given as signed (query-string) URLs have no default index location: "
                        "pass index= the index's URL")
    parts = [u.split("/")[:-1] for u in urls]
    common = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    remote = "://" in urls[0]
    if (remote and len(common) < 3) or not common:  # "s3:", "", bucket: at least a bucket
        raise SpecError(f"the shards ({redact_url(urls[0])}, ...) share no directory (several buckets "
                        "or protocols): pass index= the index's URL")
    return "/".join(common + [INDEX_NAME])


def legacy_index_url(index_url: str) -> str:
    """The index under :data:`LEGACY_INDEX_NAME` in ``index_url``'s directory."""
    return index_url.rsplit("/", 1)[0] + "/" + LEGACY_INDEX_NAME if "/" in index_url else LEGACY_INDEX_NAME


def find_index(url: str, read: Callable[..., list[ShardEntry] | None],
               storage_options: Mapping[str, Any] | None = None, config: FetchConfig | None = None,
               sightings: Sightings | None = None) -> tuple[str, list[ShardEntry] | None]:
    """``(URL, entries)`` of the index at the default location ``url`` (:data:`INDEX_NAME`) or,
    where there is none, of :data:`LEGACY_INDEX_NAME` beside it (``entries`` ``None``: neither).
    Where the listing covered the directory (``sightings``) it says which name
    exists and one of the two is read; else ``url`` is read, and the old name after a 404."""
    legacy = legacy_index_url(url)
    if sightings is not None and sightings.tells(url.rsplit("/", 1)[0]):
        if url in sightings.found or legacy not in sightings.found:
            return url, read(url, storage_options, config)
        return legacy, read(legacy, storage_options, config)
    entries = read(url, storage_options, config)
    if entries is None:
        old = read(legacy, storage_options, config)
        if old is not None:
            return legacy, old
    return url, entries


def _directory(index_url: str) -> str:
    return index_url.rsplit("/", 1)[0] + "/" if "/" in index_url else ""


def entry_name(index_url: str, shard_url: str) -> str:
    """The name a shard has in the index at ``index_url``: relative to its directory when
    under it, else the shard's absolute URL."""
    base = _directory(index_url)
    return shard_url[len(base):] if base and shard_url.startswith(base) else shard_url


# ---------------------------------------------------------------------------- storage


def _call(fs: Any, url: str, config: FetchConfig, name: str, *args: Any, what: str) -> Any:
    """One bounded, retried filesystem call (``backends.call_with_deadline``)."""
    def attempt(limit: float) -> Any:
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            from fsspec.asyn import sync

            return sync(fs.loop, getattr(fs, "_" + name), *args, timeout=limit)
        return getattr(fs, name)(*args)

    return call_with_deadline(attempt, timeout=config.timeout, deadline=listing_deadline(config),
                              url=url, what=what, retries=config.retries, backoff=config.backoff)


def _fs(url: str, storage_options: Mapping[str, Any] | None, config: FetchConfig) -> tuple[Any, str]:
    protocol, _ = split_url(url)
    fs = filesystem(protocol, storage_options, url=url, timeout=config.timeout)
    return fs, fs._strip_protocol(url)


def open_index(url: str, storage_options: Mapping[str, Any] | None = None,
               config: FetchConfig | None = None) -> Prefetcher:
    """The index's GET, sent now (one request through the prefetcher's client: no HEAD first);
    :func:`index_entries` reads its answer. Retried like the constructor's listing."""
    config = config or FetchConfig()
    # never from the local cache: an index rebuilt in place must be read anew
    config = config.replace(retry_deadline=listing_deadline(config), cache_dir=None)
    return Prefetcher([FetchItem(url, None, ((0, None),))], dict(storage_options or {}), config)


def index_entries(fetcher: Prefetcher, url: str) -> list[ShardEntry] | None:
    """The entries :func:`open_index`'s GET brought (``None``: no object there); closes it."""
    try:
        with fetcher:
            data = next(iter(fetcher)).read()
    except ShardNotFoundError as exc:
        exc.with_traceback(None)  # it is kept by the fetcher's future: keep no frames of ours
        return None
    return decode_index(data, url)


def read_index(url: str, storage_options: Mapping[str, Any] | None = None,
               config: FetchConfig | None = None) -> list[ShardEntry] | None:
    """The entries of the index at ``url`` (one GET, through the prefetcher's client: no HEAD
    first), or ``None`` when there is no such object. Retried like the constructor's listing
    (within ``urls.listing_deadline``)."""
    return index_entries(open_index(url, storage_options, config), url)


def write_index(url: str, entries: Iterable[ShardEntry], storage_options: Mapping[str, Any] | None = None,
                merge: bool = True, *, config: FetchConfig | None = None) -> None:
    """Write the index at ``url``: with ``merge``, the entries already there (at the default
    name, where there is no index there, those under :data:`LEGACY_INDEX_NAME` beside it) stay,
    and those of the same name are replaced. Entry names that are absolute URLs under the index's directory
    are made relative. Written to a temporary key, then moved over ``url``, so a reader sees the
    old index or the new one, never half of one."""
    config = config or FetchConfig()
    new = {}
    for e in entries:
        name = entry_name(url, e.name)
        new[name] = e if name == e.name else ShardEntry(name, e.size, e.etag, e.samples, e.offsets)
    old: list[ShardEntry] = []
    if merge and url.rsplit("/", 1)[-1] == INDEX_NAME:  # or the old name's entries, where only it exists
        old = find_index(url, read_index, storage_options, config)[1] or []
    elif merge:
        old = read_index(url, storage_options, config) or []
    merged = {**{e.name: e for e in old if e.offsets is not None}, **new}
    write_object(url, encode_index([merged[name] for name in sorted(merged)]), storage_options, config,
                 what="write the sample index")


def write_object(url: str, data: bytes, storage_options: Mapping[str, Any] | None, config: FetchConfig, *,
                 what: str) -> None:
    """``data`` at ``url``, written to a temporary key, then moved over ``url``: a reader sees
    the old object or the new one, never half of one."""
    fs, path = _fs(url, storage_options, config)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        if split_url(url)[0] == "file":
            fs.makedirs(posixpath.dirname(path) or ".", exist_ok=True)
        _call(fs, url, config, "pipe_file", tmp, data, what=what)
        if getattr(fs, "async_impl", False) and not hasattr(fs, "_mv"):  # s3fs: copy (atomic), delete
            _call(fs, url, config, "cp_file", tmp, path, what=what)
            _call(fs, url, config, "rm_file", tmp, what=what)
        else:
            _call(fs, url, config, "mv", tmp, path, what=what)
    except StreamDataError:
        raise
    except Exception as exc:
        raise translate_error(exc, url, what) from None
    finally:
        close_filesystem(fs)


# ---------------------------------------------------------------------------- lookup


def _match(entries: list[ShardEntry], url: str, shards: Sequence[Shard]) -> list[ShardEntry | None]:
    by_name = {e.name: e for e in entries}
    return [by_name.get(entry_name(url, s.url)) or by_name.get(s.url) for s in shards]


def _stale(shard: Shard, entry: ShardEntry) -> str | None:
    """Why ``entry`` no longer describes ``shard`` (``None``: it still does)."""
    if shard.size is not None and entry.size >= 0 and shard.size != entry.size:
        return f"its size is {shard.size} bytes, the index says {entry.size}"
    if shard.etag and entry.etag and shard.etag != entry.etag:
        return f"its ETag is {shard.etag}, the index says {entry.etag}"
    return None


def lookup(shards: Sequence[Shard], index: str | None = "auto",
           storage_options: Mapping[str, Any] | None = None,
           config: FetchConfig | None = None, *,
           read: Callable[..., list[ShardEntry] | None] | None = None,
           sightings: Sightings | None = None) -> IndexedShards | None:
    """The sample counts (and offsets) of ``shards`` from an index, read with one GET.

    ``index=None``: ``None``. ``"auto"``: the index at :func:`default_index_url`, or under its
    old name there (:func:`find_index`, told by ``sightings``); ``None`` when
    there is no object there, and, with one warning, when it lacks entries for some shards.
    A URL: that index (binary, or a wids shard-list JSON); missing, or lacking entries, is
    ``SpecError``. Either way an entry whose shard changed is ``StaleIndexError``. ``read``
    (``read_index``'s signature) reads the index: an answer fetched ahead (``catalog.index_ahead``).
    """
    if index is None or not shards:
        return None
    auto = index == "auto"
    if auto:
        try:
            url = default_index_url([s.url for s in shards])
        except SpecError:
            return None
    else:
        url = index
    shown = redact_url(url)
    try:
        if auto:
            url, entries = find_index(url, read or read_index, storage_options, config, sightings)
            shown = redact_url(url)
        else:
            entries = (read or read_index)(url, storage_options, config)
    except AccessDeniedError as exc:
        if not auto:
            raise
        # S3 answers 403, not 404, for a missing key to a caller without s3:ListBucket
        warnings.warn(f"could not read the sample index at {shown} (access denied: {exc.message[:200]}); "
                      "reading without it (index=None skips the lookup)", stacklevel=2)
        return None
    except ShardFetchError as exc:
        refused_by = getattr(exc, "refused_by", None)  # set by store.backends.translate_error
        if not auto or refused_by not in (CertificateError.__name__, ProxyAuthError.__name__):
            raise
        # the shards' own host refused us in a way no retry or index fixes: say so of the
        # shards, which the user named, not of an index file looked up on their behalf
        first = shards[0].url
        cause = re.sub(r" \[url: [^\]]*\]", "", exc.message.split(f"{shown}: ")[-1])
        raise ShardFetchError(f"cannot read {redact_url(first)} ({len(shards)} shards): {cause}",
                              url=first) from exc
    if entries is None:
        if auto:
            return None
        raise SpecError(f"no sample index at {shown}: build it with `streamdata index SPEC`, or pass "
                        "index='auto' (its default location) or index=None")
    found = _match(entries, url, shards)
    missing = [s for s, e in zip(shards, found, strict=True) if e is None]
    if missing:
        text = (f"the sample index {shown} has no entry for {len(missing)} of {len(shards)} shards "
                f"(first: {redact_url(missing[0].url)}); run `streamdata index SPEC` to add them")
        if not auto:
            raise SpecError(text, url=url)
        warnings.warn(text + "; reading without the index", stacklevel=2)
        return None
    for shard, entry in zip(shards, found, strict=True):
        why = _stale(shard, entry)  # type: ignore[arg-type]
        if why:
            raise StaleIndexError(f"the sample index {shown} is stale for {redact_url(shard.url)}: {why} "
                                  f"(the shard changed since the index was built); {REBUILD}",
                                  url=shard.url)
    return IndexedShards(url, np.array([e.samples for e in found], dtype=np.int64),  # type: ignore[union-attr]
                         [e.offsets for e in found])  # type: ignore[union-attr]


def index_status(shards: Sequence[Shard], storage_options: Mapping[str, Any] | None = None,
                 config: FetchConfig | None = None, *,
                 read: Callable[..., list[ShardEntry] | None] | None = None) -> str:
    """One line on the default index of ``shards`` (or its old name, :func:`find_index`), for
    ``streamdata inspect``; ``read`` as for :func:`lookup` (one reader for both: one GET)."""
    try:
        url, entries = find_index(default_index_url([s.url for s in shards]), read or read_index,
                                  storage_options, config)
    except StreamDataError as exc:
        return f"index: unavailable ({exc})"
    shown = redact_url(url)
    if entries is None:
        return f"index: none at {shown} (`streamdata index SPEC` builds one, for exact epochs)"
    found = _match(entries, url, shards)
    stale = sum(1 for s, e in zip(shards, found, strict=True) if e is not None and _stale(s, e))
    missing = sum(e is None for e in found)
    samples = sum(e.samples for e in found if e is not None)
    line = f"index: {shown}: {len(shards) - missing}/{len(shards)} shards, {samples} samples"
    if stale or missing:
        line += f", {stale} stale, {missing} missing: run `streamdata index SPEC`"
    return line


# ---------------------------------------------------------------------------- building

COMPRESSED = (".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
SAVE_EVERY_S = 5.0  # the partial index is written this often while building (and at the end),
SAVE_COST_RATIO = 10  # and at most 1/10 of the time: a big index's write takes longer


def _counted(chunks: Iterable[bytes], seen: list[int], bar: Any) -> Iterator[bytes]:
    for chunk in chunks:
        seen[0] += len(chunk)
        bar.update(len(chunk))
        yield chunk


def build_index(spec: Spec, storage_options: Mapping[str, Any] | None = None, output: str | None = None, *,
                progress: bool | Callable[[ShardEntry], None] | None = None, **fetch_options: Any) -> str:
    """Index every uncompressed tar shard of ``spec``; returns the URL written.

    ``output``: the index's URL (default :func:`default_index_url` of the shards). Shards are
    read whole, in parallel, through the prefetcher (``fetch_options``: ``window``,
    ``max_requests``, ``part_size``, ..., or ``config=`` a ``FetchConfig``). Resumable: an entry
    already in ``output`` whose shard's size and ETag still match is kept and that shard not
    read; the index (with the entries of shards outside ``spec`` kept) is written every
    :data:`SAVE_EVERY_S` seconds (less often when writing it takes more than a tenth of that)
    and at the end, also when interrupted. ``progress``: a bar of
    bytes on stderr (``None``: when it is a terminal; ``True``/``False``), or a callable, given
    each new entry as it is made (the bar then shows when stderr is a terminal). A shard that
    cannot be read or parsed does not stop the others; the first such error is raised at the
    end, after the rest are saved. Compressed shards are skipped with a warning.
    """
    config = FetchConfig.resolve(fetch_options.pop("config", None), **fetch_options)
    shards = expand_spec(spec, storage_options, suffixes=(".tar", *COMPRESSED), config=config)
    compressed = [s for s in shards if s.url.endswith(COMPRESSED)]
    if compressed:
        named = ", ".join(redact_url(s.url) or "" for s in compressed[:3])
        warnings.warn(f"{len(compressed)} compressed shard(s) get no sample index (a ranged read cannot "
                      f"start inside a compressed stream): {named}{', ...' if len(compressed) > 3 else ''}",
                      stacklevel=2)
        shards = [s for s in shards if not s.url.endswith(COMPRESSED)]
    if not shards:
        raise SpecError(f"nothing to index in {spec!r}: no uncompressed .tar shards")
    if output is None:  # an index under the old name there is resumed from, and the new one written
        output = default_index_url([s.url for s in shards])
        _, found = find_index(output, read_index, storage_options, config)
    else:
        found = read_index(output, storage_options, config)
    entries = {e.name: e for e in found or [] if e.offsets is not None}
    todo: list[Shard] = []
    for shard in shards:  # RESUME: keep what is still fresh, drop what is stale
        name = entry_name(output, shard.url)
        entry = entries.get(name)
        if entry is None or shard.size is None or _stale(shard, entry):
            entries.pop(name, None)
            todo.append(shard)
    failures: list[StreamDataError] = []
    sizes = [s.size for s in todo if s.size is not None]
    total = sum(sizes) if len(sizes) == len(todo) else None
    bar = _progress(total, desc=f"indexing {len(todo)} shards", unit="B", unit_scale=True,
                    enabled=progress if isinstance(progress, bool) else None)
    saved, cost = time.monotonic(), 0.0
    try:
        with bar, Prefetcher(todo, dict(storage_options or {}), config) as fetcher:
            for shard, reader in zip(todo, fetcher, strict=True):
                seen = [0]
                try:
                    with contextlib.closing(reader.chunks()) as chunks:
                        counted = _counted(chunks, seen, bar)
                        offsets = tar_sample_offsets(counted, redact_url(shard.url) or "", total=shard.size)
                        for _ in counted:  # the padding after the end-of-archive marker: the size
                            pass
                except StreamDataError as exc:
                    failures.append(exc)
                    continue
                name = entry_name(output, shard.url)
                entries[name] = ShardEntry(name, seen[0], shard.etag, len(offsets) - 1, offsets)
                if callable(progress):
                    progress(entries[name])
                if time.monotonic() - saved >= max(SAVE_EVERY_S, SAVE_COST_RATIO * cost):
                    began = time.monotonic()
                    write_index(output, entries.values(), storage_options, merge=False, config=config)
                    saved = time.monotonic()
                    cost = saved - began
    finally:
        write_index(output, entries.values(), storage_options, merge=False, config=config)
    if failures:
        err = failures[0]
        err.message += (f" ({len(failures)} of {len(todo)} shards could not be indexed; {output} holds "
                        f"the other {len(todo) - len(failures)}: {REBUILD} to index the rest)")
        raise err
    return output
