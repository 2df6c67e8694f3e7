"""The sample index's bytes (format v1), and a tar shard's sample offsets.

Format v1 (little-endian)::

    b"SDIDX\\x00"  u16 version (1)  u64 header length  header (UTF-8 JSON)  offsets

The header is ``{"format": "streamdata-index", "version": 1, "shards": [{"name", "size",
"etag", "samples"}, ...], "crc32": ...}``; then, for each shard in header order,
``samples + 1`` uint64 offsets: offset ``i`` is the byte where sample ``i``'s first header
block begins (its long-name or pax header, if any), the last is where the end-of-archive
marker begins, so samples ``[a, b)`` are bytes ``[off[a], off[b])`` (``tar.sample_offsets``
defines the boundaries). About 8 bytes per sample, plus some 70 per shard. ``crc32`` is
zlib's CRC-32 of the ``shards`` list as compact JSON with sorted keys, continued over the
offsets, so a changed byte anywhere is caught. Reading checks the rest too: offsets that do
not increase within a shard, or pass its size, are ``FormatError``.

A WebDataset/wids shard list (``{"shardlist": [{"url", "nsamples", "filesize"?}, ...]}``) is
read as an index too: counts, no offsets. Where they are stored and how they are looked up:
``streamdata.catalog.index``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from streamdata.errors import FormatError, SpecError
from streamdata.formats.tar import sample_offsets
from streamdata.redact import redact_url

__all__ = ["FORMAT", "MAGIC", "REBUILD", "VERSION", "ShardEntry", "decode_index", "encode_index",
           "tar_sample_offsets"]

MAGIC = b"SDIDX\x00"
VERSION = 1
FORMAT = "streamdata-index"
REBUILD = "run `streamdata index SPEC` again"
_PREAMBLE = struct.Struct("<HQ")


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
    return FormatError(f"corrupt sample index {url}: {what}; delete it and {REBUILD}", url=url)


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
                          f"version {VERSION}: upgrade streamdata, or {REBUILD}", url=url)
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
    payload = memoryview(data)[start + length:]  # not copied
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
    bounds, sizes_, samples_ = [0, *ends.tolist()], sizes.tolist(), samples.tolist()  # Python ints: fast
    return [ShardEntry(names[i], sizes_[i], etags[i], samples_[i], flat[bounds[i]:bounds[i + 1]])
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
