"""The sample index: per tar shard, its sample count and each sample's byte offset.

One index object per directory of shards, ``<directory>/streamdata.sdx`` (:data:`INDEX_NAME`;
for shards in several directories, their longest common directory). Its entries are keyed by
the shard's URL relative to that directory (the absolute URL for a shard outside it), so a
copied bucket keeps a working index.

Format v1 (little-endian)::

    b"SDIDX\\x00"  u16 version (1)  u64 header length  header (UTF-8 JSON)  offsets

The header is ``{"format": "streamdata-index", "version": 1, "shards": [{"name", "size",
"etag", "samples"}, ...], "crc32": ...}``; then, for each shard in header order,
``samples + 1`` uint64 offsets: offset ``i`` is the byte where sample ``i``'s first header
block begins (its long-name or pax header, if any), the last is where the end-of-archive
marker begins, so samples ``[a, b)`` are bytes ``[off[a], off[b])`` (``formats.tar.
sample_offsets`` defines the boundaries). About 8 bytes per sample. ``crc32`` is zlib's CRC
of the ``shards`` list as compact sorted JSON followed by the offsets, so a changed byte
anywhere is caught. A WebDataset/wids shard list (``{"shardlist": [{"url", "nsamples"}, ...]}``)
is read as an index too: counts, no offsets.

An entry is *stale* when its shard's size, or its ETag where both are known, differs from the
listing: :func:`lookup` refuses it (``StaleIndexError``) rather than read wrong bytes.
Building (``build_index``, in ``indexing``) reads every shard through the prefetcher.
"""

from __future__ import annotations

import json
import posixpath
import struct
import uuid
import warnings
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends import call_with_deadline, close_filesystem, filesystem, translate_error
from .config import FetchConfig
from .errors import FormatError, ShardNotFoundError, SpecError, StaleIndexError, StreamDataError
from .fetch import FetchItem, Prefetcher
from .formats.tar import sample_offsets
from .redact import redact_url
from .urls import Shard, listing_deadline, split_url

__all__ = ["INDEX_NAME", "IndexedShards", "ShardEntry", "decode_index", "default_index_url",
           "encode_index", "entry_name", "index_status", "lookup", "read_index", "tar_sample_offsets",
           "write_index"]

INDEX_NAME = "streamdata.sdx"
MAGIC = b"SDIDX\x00"
VERSION = 1
FORMAT = "streamdata-index"
_PREAMBLE = struct.Struct("<HQ")
_REBUILD = "run `streamdata index SPEC` again"


@dataclass(frozen=True, eq=False)
class ShardEntry:
    """One shard in an index: ``name`` (URL relative to the index's directory, or absolute),
    ``size`` in bytes (``-1``: unknown, a wids list without ``filesize``), ``etag`` (``None``:
    unknown), sample count, and ``samples + 1`` uint64 offsets (``None``: counts only)."""

    name: str
    size: int
    etag: str | None
    samples: int
    offsets: np.ndarray | None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardEntry):
            return NotImplemented
        same = (self.name, self.size, self.etag, self.samples) == (
            other.name, other.size, other.etag, other.samples)
        if self.offsets is None or other.offsets is None:
            return same and self.offsets is other.offsets
        return same and np.array_equal(self.offsets, other.offsets)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class IndexedShards:
    """What :func:`lookup` found: the index's URL, sample counts aligned with the shards,
    and each shard's offsets (``None`` where the index has counts only)."""

    url: str
    counts: np.ndarray
    offsets: list[np.ndarray | None]


# ---------------------------------------------------------------------------- locations


def default_index_url(urls: Sequence[str]) -> str:
    """``<longest common directory of urls>/streamdata.sdx``; ``SpecError`` when the shards
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


def _directory(index_url: str) -> str:
    return index_url.rsplit("/", 1)[0] + "/" if "/" in index_url else ""


def entry_name(index_url: str, shard_url: str) -> str:
    """The name a shard has in the index at ``index_url``: relative to its directory when
    under it, else the shard's absolute URL."""
    base = _directory(index_url)
    return shard_url[len(base):] if base and shard_url.startswith(base) else shard_url


# ---------------------------------------------------------------------------- format


def _canonical(shards: list[dict]) -> bytes:
    return json.dumps(shards, separators=(",", ":"), sort_keys=True).encode()


def encode_index(entries: Sequence[ShardEntry]) -> bytes:
    """The v1 bytes of an index (entries in the given order; each must carry offsets)."""
    shards, arrays = [], []
    for e in entries:
        if e.offsets is None:
            raise SpecError(f"index entry {e.name!r} has counts but no offsets: the binary index "
                            "holds offsets (build it with `streamdata index SPEC`)")
        offsets = np.asarray(e.offsets, dtype="<u8")
        if offsets.shape != (e.samples + 1,):
            raise SpecError(f"index entry {e.name!r}: {e.samples} samples need {e.samples + 1} "
                            f"offsets, got {offsets.shape}")
        shards.append({"name": e.name, "size": int(e.size), "etag": e.etag, "samples": int(e.samples)})
        arrays.append(offsets.tobytes())
    payload = b"".join(arrays)
    crc = zlib.crc32(payload, zlib.crc32(_canonical(shards)))
    header = json.dumps({"format": FORMAT, "version": VERSION, "shards": shards, "crc32": crc},
                        separators=(",", ":")).encode()
    return MAGIC + _PREAMBLE.pack(VERSION, len(header)) + header + payload


def _corrupt(url: str, what: str) -> FormatError:
    return FormatError(f"corrupt sample index {url}: {what}; delete it and {_REBUILD}", url=url)


def decode_index(data: bytes, url: str) -> list[ShardEntry]:
    """Entries of an index's bytes: the v1 binary format, or a wids shard-list JSON (counts
    only). Anything else, a bad checksum or an unknown version is ``FormatError`` naming ``url``."""
    url = redact_url(url) or ""
    if not data.startswith(MAGIC):
        if data.lstrip()[:1] == b"{":
            return _decode_wids(data, url)
        raise _corrupt(url, "not a streamdata index (bad magic) nor a shard-list JSON")
    if len(data) < len(MAGIC) + _PREAMBLE.size:
        raise _corrupt(url, f"{len(data)} bytes, shorter than the preamble")
    version, length = _PREAMBLE.unpack_from(data, len(MAGIC))
    if version != VERSION:
        raise FormatError(f"sample index {url} has format version {version}; this streamdata reads "
                          f"version {VERSION}: upgrade streamdata, or {_REBUILD}", url=url)
    start = len(MAGIC) + _PREAMBLE.size
    try:
        header = json.loads(data[start:start + length])
        shards = header["shards"]
        names = [str(s["name"]) for s in shards]
        sizes = np.array([s["size"] for s in shards], dtype=np.int64)
        etags = [s["etag"] for s in shards]
        samples = np.array([s["samples"] for s in shards], dtype=np.int64)
        crc = int(header["crc32"])
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise _corrupt(url, f"unreadable header ({type(exc).__name__}: {exc})") from None
    if header.get("format") != FORMAT or (sizes < 0).any() or (samples < 0).any() \
            or not all(e is None or isinstance(e, str) for e in etags):
        raise _corrupt(url, "header fields out of range")
    payload = data[start + length:]
    want = 8 * int((samples + 1).sum())
    if len(payload) != want:
        raise _corrupt(url, f"{len(payload)} bytes of offsets where the header says {want}")
    if zlib.crc32(payload, zlib.crc32(_canonical(shards))) != crc:
        raise _corrupt(url, "checksum mismatch")
    flat = np.frombuffer(payload, dtype="<u8")
    ends = np.cumsum(samples + 1)
    steps = np.diff(flat.astype(np.int64))
    inside = np.ones(len(steps), dtype=bool)
    inside[ends[:-1] - 1] = False  # a step from one shard's last offset to the next's first
    if (steps[inside] <= 0).any() or (len(ends) and (flat[ends - 1] > sizes.astype(np.uint64)).any()):
        raise _corrupt(url, "offsets that decrease or pass the end of their shard")
    bounds = np.concatenate([[0], ends])
    return [ShardEntry(names[i], int(sizes[i]), etags[i], int(samples[i]), flat[bounds[i]:bounds[i + 1]])
            for i in range(len(names))]


def _decode_wids(data: bytes, url: str) -> list[ShardEntry]:
    """A WebDataset/wids shard list: ``{"shardlist": [{"url", "nsamples", "filesize"?}...]}``."""
    try:
        items = json.loads(data)["shardlist"]
        return [ShardEntry(str(i["url"]), int(i.get("filesize", -1)), None, int(i["nsamples"]), None)
                for i in items]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"unreadable shard-list JSON {url}: {type(exc).__name__}: {exc} (a wids list "
                          "is {\"shardlist\": [{\"url\": ..., \"nsamples\": ...}, ...]})", url=url) from None


def tar_sample_offsets(chunks: Iterable[bytes], url: str, total: int | None = None) -> np.ndarray:
    """The ``samples + 1`` uint64 offsets of a tar shard's bytes (``formats.tar.sample_offsets``)."""
    return np.asarray(sample_offsets(chunks, url, total=total), dtype=np.uint64)


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


def read_index(url: str, storage_options: Mapping[str, Any] | None = None,
               config: FetchConfig | None = None) -> list[ShardEntry] | None:
    """The entries of the index at ``url`` (one GET, through the prefetcher's client: no HEAD
    first), or ``None`` when there is no such object. Retried like the constructor's listing
    (within ``urls.listing_deadline``)."""
    config = config or FetchConfig()
    config = config.replace(retry_deadline=listing_deadline(config))
    try:
        with Prefetcher([FetchItem(url, None, ((0, None),))], dict(storage_options or {}), config) as fetcher:
            data = next(iter(fetcher)).read()
    except ShardNotFoundError:
        return None
    return decode_index(data, url)


def write_index(url: str, entries: Iterable[ShardEntry], storage_options: Mapping[str, Any] | None = None,
                merge: bool = True, *, config: FetchConfig | None = None) -> None:
    """Write the index at ``url``: with ``merge``, the entries already there stay, and those of
    the same name are replaced. Entry names that are absolute URLs under the index's directory
    are made relative. Written to a temporary key, then moved over ``url``, so a reader sees the
    old index or the new one, never half of one."""
    config = config or FetchConfig()
    new = {}
    for e in entries:
        name = entry_name(url, e.name)
        new[name] = e if name == e.name else ShardEntry(name, e.size, e.etag, e.samples, e.offsets)
    old = (read_index(url, storage_options, config) or []) if merge else []
    merged = {**{e.name: e for e in old if e.offsets is not None}, **new}
    data = encode_index([merged[name] for name in sorted(merged)])
    fs, path = _fs(url, storage_options, config)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        if split_url(url)[0] == "file":
            fs.makedirs(posixpath.dirname(path) or ".", exist_ok=True)
        _call(fs, url, config, "pipe_file", tmp, data, what="write the sample index")
        if getattr(fs, "async_impl", False) and not hasattr(fs, "_mv"):  # s3fs: copy (atomic), delete
            _call(fs, url, config, "copy", tmp, path, what="write the sample index")
            _call(fs, url, config, "rm", tmp, what="write the sample index")
        else:
            _call(fs, url, config, "mv", tmp, path, what="write the sample index")
    except StreamDataError:
        raise
    except Exception as exc:
        raise translate_error(exc, url, "write the sample index") from None
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
           config: FetchConfig | None = None) -> IndexedShards | None:
    """The sample counts (and offsets) of ``shards`` from an index, read with one GET.

    ``index=None``: ``None``. ``"auto"``: the index at :func:`default_index_url`; ``None`` when
    there is no object there, and, with one warning, when it lacks entries for some shards.
    A URL: that index (binary, or a wids shard-list JSON); missing, or lacking entries, is
    ``SpecError``. Either way an entry whose shard changed is ``StaleIndexError``.
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
    entries = read_index(url, storage_options, config)
    shown = redact_url(url)
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
                                  f"(the shard changed since the index was built); {_REBUILD}",
                                  url=shard.url)
    return IndexedShards(url, np.array([e.samples for e in found], dtype=np.int64),  # type: ignore[union-attr]
                         [e.offsets for e in found])  # type: ignore[union-attr]


def index_status(shards: Sequence[Shard], storage_options: Mapping[str, Any] | None = None,
                 config: FetchConfig | None = None) -> str:
    """One line on the default index of ``shards``, for ``streamdata inspect``."""
    try:
        url = default_index_url([s.url for s in shards])
        entries = read_index(url, storage_options, config)
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
