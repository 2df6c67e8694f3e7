"""Tar bytes -> samples, streaming, following the WebDataset layout.

The parser reads 512-byte headers straight from the fetcher's parts (no temp files, no
``tarfile`` object per member): memory is one part plus the member being assembled.
Handles ustar names with a prefix, GNU long names (``L``) and pax ``path``/``size``
records; directories, links and other special members are skipped.

Sample grouping follows WebDataset: the key is the member path up to the first dot of
its basename, the rest (lower-cased) is the field name; ``__key__`` and ``__url__`` are
added; top-level ``__name__`` style members are metadata and skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from ..errors import FormatError

__all__ = ["group_samples", "iter_members", "samples_from_chunks", "split_key"]

_BLOCK = 512
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")


class _Stream:
    """Sequential reads over an iterator of byte chunks."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks = iter(chunks)
        self._buf = b""
        self._pos = 0
        self.offset = 0  # bytes consumed so far

    def take(self, n: int) -> bytes | None:
        """The next ``n`` bytes, or ``None`` if the stream ends first (a short tail is lost)."""
        buf, pos = self._buf, self._pos
        if pos + n <= len(buf):
            self._pos = pos + n
            self.offset += n
            return buf[pos:pos + n] if (pos or n != len(buf)) else buf
        pieces = [buf[pos:]] if pos < len(buf) else []
        got = len(buf) - pos
        self._buf, self._pos = b"", 0
        while got < n:
            chunk = next(self._chunks, None)
            if chunk is None:
                self.offset += got
                return None
            need = n - got
            if len(chunk) > need:
                pieces.append(chunk[:need])
                self._buf, self._pos = chunk, need
                got = n
            else:
                pieces.append(chunk)
                got += len(chunk)
        self.offset += n
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def skip(self, n: int) -> bool:
        """Drop ``n`` bytes; False if the stream ends first."""
        while n > 0:
            avail = len(self._buf) - self._pos
            if avail == 0:
                chunk = next(self._chunks, None)
                if chunk is None:
                    return False
                self._buf, self._pos = chunk, 0
                continue
            step = min(avail, n)
            self._pos += step
            self.offset += step
            n -= step
        return True


def _octal(field: bytes, url: str, offset: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.rstrip(b" \0").strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise FormatError(f"corrupt tar header in {url} at byte {offset}: bad number {field!r}",
                          url=url) from None


def _checksum_ok(header: bytes) -> bool:
    stored = header[148:156].rstrip(b" \0").strip()
    try:
        want = int(stored, 8)
    except ValueError:
        return False
    total = sum(header) - sum(header[148:156]) + 8 * 32
    return total == want


def _pax(records: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(records):
        space = records.index(b" ", pos)
        length = int(records[pos:space])
        key, _, value = records[space + 1:pos + length - 1].partition(b"=")
        out[key.decode("utf-8")] = value.decode("utf-8")
        pos += length
    return out


def iter_members(chunks: Iterable[bytes], url: str = "") -> Iterator[tuple[str, bytes]]:
    """Yield ``(path, data)`` for each regular file of a tar stream given as byte chunks."""
    stream = _Stream(chunks)
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        at = stream.offset
        header = stream.take(_BLOCK)
        if header is None:
            if stream.offset == at:
                return  # clean end without the (optional) zero blocks
            raise FormatError(f"truncated tar {url}: it ends inside a header at byte {at}", url=url)
        if header.count(0) == _BLOCK:
            return  # end-of-archive marker
        if not _checksum_ok(header):
            raise FormatError(f"corrupt tar {url}: bad header checksum at byte {at} "
                              "(not a tar file, or damaged)", url=url)
        kind = header[156:157]
        size = _octal(header[124:136], url, at)
        if "size" in pax:
            size = int(pax["size"])
        name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if header[257:262] == b"ustar":
            prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if prefix:
                name = f"{prefix}/{name}"
        padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind in (b"L", b"x", b"g"):
            data = stream.take(padded)
            if data is None:
                raise FormatError(f"truncated tar {url}: ends inside an extended header at byte {at}",
                                  url=url)
            if kind == b"L":
                long_name = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            elif kind == b"x":
                pax = _pax(data[:size])
            continue
        if long_name is not None:
            name, long_name = long_name, None
        if "path" in pax:
            name = pax["path"]
        pax = {}
        if kind not in (b"0", b"\0", b"7"):  # directory, link, device...: nothing to read
            if not stream.skip(padded):
                raise FormatError(f"truncated tar {url}: ends inside member {name!r}", url=url)
            continue
        data = stream.take(size)
        if data is None or not stream.skip(padded - size):
            raise FormatError(f"truncated tar {url}: ends inside member {name!r} "
                              f"(header at byte {at}, {size} bytes expected)", url=url)
        yield name, data


def split_key(path: str) -> tuple[str, str] | None:
    """``"dir/abc.seg.png"`` -> ``("dir/abc", "seg.png")``; ``None`` for a name without extension."""
    m = _KEY.match(path)
    return (m.group(1), m.group(2)) if m else None


def group_samples(members: Iterable[tuple[str, bytes]], url: str = "") -> Iterator[dict]:
    """Group consecutive members sharing a key into sample dicts (WebDataset convention)."""
    sample: dict | None = None
    for path, data in members:
        if "/" not in path and path.startswith("__") and path.endswith("__") or _META.match(path):
            continue
        parts = split_key(path)
        if parts is None:
            continue
        key, field = parts[0], parts[1].lower()
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        if field in sample:
            raise FormatError(f"duplicate member {path!r} in {url}: field {field!r} of sample "
                              f"{key!r} appears twice (members of a sample must be adjacent and unique)",
                              url=url, key=key)
        sample[field] = data
    if sample is not None:
        yield sample


def samples_from_chunks(chunks: Iterable[bytes], url: str = "") -> Iterator[dict]:
    """Tar byte chunks -> WebDataset sample dicts of raw bytes."""
    return group_samples(iter_members(chunks, url), url)
