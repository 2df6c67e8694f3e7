"""Tar bytes -> samples, streaming, following the WebDataset layout.

The parser reads 512-byte headers straight from the fetcher's parts (no temp files, no
``tarfile`` object per member): memory is one part plus the member being assembled.
Handles ustar names with a prefix, GNU long names (``L``, ``K``), base-256 numbers and pax
``path``/``size`` records; directories, links and other special members are skipped.

Malformed input of any kind (a bad checksum, number, pax record or size, a member larger
than the object, truncation anywhere) raises :class:`FormatError` naming the URL and the
byte offset; no other exception escapes the parser.  Names that are not UTF-8 (latin-1 from
older tools) are decoded with ``surrogateescape``, as ``tarfile`` (and so webdataset) does:
each undecodable byte becomes one lone surrogate, and the key round-trips to the bytes.

Invariant (TAR-PROGRESS): every loop iteration consumes input.  The member loop takes a
512-byte header first; the pax loop advances by the record's length, which is checked to be
at least the shortest record (``"5 k=\\n"``) before use; the stream's reads advance by each
chunk.  So any input, however mutated, ends in a bounded number of steps: in samples, or in
``FormatError``.

Sample grouping follows WebDataset: the key is the member path up to the first dot of
its basename, the rest (lower-cased) is the field name; ``__key__`` and ``__url__`` are
added; top-level ``__name__`` style members are metadata and skipped.

Offsets (for the sample index): :func:`member_offsets` gives each regular member's first
header offset (its first extension header counts), and :func:`sample_offsets` where each
sample begins, under the same grouping rules, so that a ranged read of ``[off[a], off[b])``
parses to exactly samples ``a .. b-1``.

End of archive: a tar ends with two zero blocks.  A stream that stops at a member boundary
without them (a half-uploaded shard, a zero-byte object) is :class:`FormatError` by default;
with ``accept_unterminated`` its members are delivered and ``on_unterminated`` is called.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Generator, Iterable, Iterator

from streamdata.errors import FormatError

__all__ = ["group_samples", "iter_members", "member_offsets", "sample_offsets", "samples_from_chunks",
           "split_key"]

_BLOCK = 512
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_REGULAR = (b"0", b"\0", b"7")
_NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")  # links, devices, dirs, fifos: tarfile reads no data
_EXTENSIONS = (b"L", b"K", b"x", b"g", b"X")  # records about the next member
_MAX_EXTENSION = 1 << 20  # bytes of one long-name or pax record block we are willing to hold
_MIN_PAX_RECORD = 5  # "5 k=\n"
_OCTAL = b"01234567"


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
        while got < n:  # TAR-PROGRESS: each turn takes the next chunk
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
        while n > 0:  # TAR-PROGRESS: each turn drops bytes or takes the next chunk
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


def _corrupt(url: str, offset: int, what: str) -> FormatError:
    return FormatError(f"corrupt tar {url}: {what} at byte {offset}", url=url)


def _truncated(url: str, offset: int, what: str) -> FormatError:
    return FormatError(f"truncated tar {url}: it ends inside {what} (header at byte {offset})", url=url)


def _number(field: bytes, url: str, offset: int, what: str) -> int:
    """A header number: octal text, or GNU base-256 (first byte 0x80, or 0xff: negative)."""
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0xFF else n
    text = field.split(b"\0", 1)[0].strip(b" ")
    if text and text.translate(None, _OCTAL):  # only 0-7: int() would take "+", "_", ...
        raise _corrupt(url, offset, f"bad {what} {field!r} in a header")
    return int(text, 8) if text else 0


def _byte_sum(header: bytes) -> int:
    """The sum of a 512-byte header's bytes, exactly: Adler-32's first half is 1 + the byte sum
    modulo 65521, and a 256-byte half sums to at most 65280 (4x faster than ``sum``)."""
    view = memoryview(header)
    return (zlib.adler32(view[:256]) & 0xFFFF) + (zlib.adler32(view[256:]) & 0xFFFF) - 2


def _checksum_ok(header: bytes) -> bool:
    """The stored checksum matches the unsigned sum, or the signed one some old tars used."""
    stored = header[148:156].split(b"\0", 1)[0].strip(b" ")
    if not stored or stored.translate(None, _OCTAL):
        return False
    want = int(stored, 8)
    if want == _byte_sum(header) - sum(header[148:156]) + 8 * 32:  # unsigned: every tool since the 1990s
        return True
    return want == sum(struct.unpack_from("148b8x356b", header)) + 8 * 32


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _pax(records: bytes, url: str, offset: int) -> dict[str, str]:
    """Pax ``"<len> <key>=<value>\\n"`` records (``offset``: where they start in the object)."""
    out, pos = {}, 0
    while pos < len(records) and records[pos] != 0:  # TAR-PROGRESS: pos grows by length >= 5
        space = records.find(b" ", pos, pos + 21)
        digits = records[pos:space] if space > pos else b""
        if not digits or not digits.isdigit():
            raise _corrupt(url, offset + pos, "a pax record without a length")
        length = int(digits)
        end = pos + length
        if length < max(_MIN_PAX_RECORD, space - pos + 4) or end > len(records) \
                or records[end - 1] != 0x0A:
            raise _corrupt(url, offset + pos, f"a pax record of bad length {length}")
        key, eq, value = records[space + 1:end - 1].partition(b"=")
        if not key or not eq:
            raise _corrupt(url, offset + pos, "a pax record without 'key='")
        out[_text(key)] = _text(value)
        pos = end
    return out


def _pax_size(pax: dict[str, str], url: str, offset: int) -> int | None:
    if "size" not in pax:
        return None
    text = pax["size"]
    if not (text.isascii() and text.isdigit()):
        raise _corrupt(url, offset, f"a pax size {text!r}")
    return int(text)


def _unterminated(url: str, at: int, accept: bool, callback: Callable[[], None] | None) -> None:
    """A stream that stopped at a member boundary, without (all of) the end-of-archive marker."""
    if not accept:
        what = " (a zero-byte object)" if at == 0 else ""
        raise FormatError(f"unterminated tar {url}: it ends at byte {at}{what} without the "
                          "end-of-archive marker (truncated at a member boundary? "
                          "accept_unterminated=True reads such shards)", url=url)
    if callback is not None:
        callback()


def iter_members(chunks: Iterable[bytes], url: str = "", *, total: int | None = None,
                 accept_unterminated: bool = False,
                 on_unterminated: Callable[[], None] | None = None) -> Iterator[tuple[str, bytes]]:
    """Yield ``(path, data)`` for each regular file of a tar stream given as byte chunks.

    ``total``, when known, is the object's size: a member said to be larger than what is left
    is refused at its header.  A stream without the end-of-archive marker (or with no bytes at
    all) raises ``FormatError``, unless ``accept_unterminated``: then ``on_unterminated()`` is
    called once its members have been yielded.
    """
    walk = _walk(_Stream(chunks), url, total, accept_unterminated, on_unterminated, keep_data=True)
    for name, _, data in walk:
        yield name, data  # type: ignore[misc]


def member_offsets(chunks: Iterable[bytes], url: str = "", *, total: int | None = None,
                   accept_unterminated: bool = False) -> Iterator[tuple[str, int]]:
    """Yield ``(path, offset)`` for each regular file, like :func:`iter_members` but without
    holding member data: ``offset`` is the byte where the member's first header block begins,
    its first extension header (GNU long name ``L``/``K``, pax ``x``/``g``) if it has any.
    The generator's return value (``StopIteration.value``) is the byte where the
    end-of-archive marker begins (with ``accept_unterminated``: where the stream ended)."""
    walk = _walk(_Stream(chunks), url, total, accept_unterminated, None, keep_data=False)
    while True:  # TAR-PROGRESS: each turn takes the next member (or ends)
        try:
            name, start, _ = next(walk)
        except StopIteration as stop:
            return stop.value
        yield name, start


def _walk(stream: _Stream, url: str, total: int | None, accept_unterminated: bool,
          on_unterminated: Callable[[], None] | None, *,
          keep_data: bool) -> Generator[tuple[str, int, bytes | None], None, int]:
    """The member loop: ``(path, first header offset, data or None)`` per regular file;
    returns the offset where the end-of-archive marker begins."""
    long_name: str | None = None
    pax: dict[str, str] = {}
    start: int | None = None  # where the current member's first (extension) header began
    while True:  # TAR-PROGRESS: each turn takes a 512-byte header, or ends
        at = stream.offset
        header = stream.take(_BLOCK)
        zero = header is not None and not header[0] and header.count(0) == _BLOCK  # a name: not zero
        if zero:
            second = stream.take(_BLOCK)
            if second == bytes(_BLOCK) and long_name is None and not pax:
                return at  # the end-of-archive marker: two zero blocks (what follows is padding)
            if second is not None:
                raise _corrupt(url, at, "a zero block after an extended header, or followed by "
                               "data (a damaged header?)")
        if header is None or zero:  # the stream ended before a marker
            if stream.offset != at and header is None or long_name is not None or pax:
                raise _truncated(url, at, "a header")
            _unterminated(url, at, accept_unterminated, on_unterminated)
            return at
        if not _checksum_ok(header):
            raise _corrupt(url, at, "a bad header checksum (not a tar file, or damaged)")
        if start is None:
            start = at
        kind = header[156:157]
        size = _number(header[124:136], url, at, "size")
        name = _text(header[0:100].split(b"\0", 1)[0])
        if header[257:262] == b"ustar":
            prefix = _text(header[345:500].split(b"\0", 1)[0])
            if prefix:
                name = f"{prefix}/{name}"
        if kind in _EXTENSIONS:
            if not 0 <= size <= _MAX_EXTENSION:
                raise _corrupt(url, at, f"an extended header of {size} bytes")
            data = stream.take((size + _BLOCK - 1) // _BLOCK * _BLOCK)
            if data is None:
                raise _truncated(url, at, "an extended header")
            if kind == b"L":
                long_name = _text(data[:size].split(b"\0", 1)[0])
            elif kind == b"x" or kind == b"X":
                pax = {**pax, **_pax(data[:size], url, at + _BLOCK)}
            continue
        if long_name is not None:
            name, long_name = long_name, None
        pax_size = _pax_size(pax, url, at)
        size = size if pax_size is None else pax_size
        name = pax.get("path", name)
        pax = {}
        member_start, start = start, None
        if size < 0 or total is not None and at + _BLOCK + size > total:
            raise _corrupt(url, at, f"member {name!r} of {size} bytes"
                           + ("" if total is None else f" in an object of {total} bytes"))
        padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if kind in _NO_DATA or kind == b"\0" and name.endswith("/"):
            continue  # a directory, link or device: like tarfile, no data follows
        if kind not in _REGULAR:  # another type: its data is skipped
            if not stream.skip(padded):
                raise _truncated(url, at, f"member {name!r}")
            continue
        if not keep_data:  # offsets only: the data is skipped, not held
            if not stream.skip(padded):
                raise _truncated(url, at, f"member {name!r} ({size} bytes)")
            yield name, member_start, None
            continue
        data = stream.take(size)
        if data is None or not stream.skip(padded - size):
            raise _truncated(url, at, f"member {name!r} ({size} bytes)")
        yield name, member_start, data


def split_key(path: str) -> tuple[str, str] | None:
    """``"dir/abc.seg.png"`` -> ``("dir/abc", "seg.png")``; ``None`` for a name without extension."""
    m = _KEY.match(path)
    return (m.group(1), m.group(2)) if m else None


def _sample_field(path: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member that belongs to a sample; ``None`` for one that
    :func:`group_samples` ignores (``__meta__`` style metadata, a name without extension)."""
    if "/" not in path and path.startswith("__") and path.endswith("__") or _META.match(path):
        return None
    parts = split_key(path)
    return None if parts is None else (parts[0], parts[1].lower())


def _duplicate(path: str, url: str, key: str, field: str) -> FormatError:
    return FormatError(f"duplicate member {path!r} in {url}: field {field!r} of sample "
                       f"{key!r} appears twice (members of a sample must be adjacent and unique)",
                       url=url, key=key)


def group_samples(members: Iterable[tuple[str, bytes]], url: str = "") -> Iterator[dict]:
    """Group consecutive members sharing a key into sample dicts (WebDataset convention)."""
    sample: dict | None = None
    for path, data in members:
        parts = _sample_field(path)
        if parts is None:
            continue
        key, field = parts
        if sample is None or sample["__key__"] != key:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        if field in sample:
            raise _duplicate(path, url, key, field)
        sample[field] = data
    if sample is not None:
        yield sample


def sample_offsets(chunks: Iterable[bytes], url: str = "", *, total: int | None = None) -> list[int]:
    """Where each sample of a tar stream begins, and where the last one ends: ``samples + 1``
    byte offsets, for a ranged read of samples ``[a, b)`` as bytes ``[off[a], off[b])``.

    Sample boundaries follow :func:`group_samples` exactly. Sample ``i`` begins at the first
    header block (its first extension header, if any) of the first member whose key differs
    from the previous sample's key. Members that ``group_samples`` ignores (``__meta__``
    style names, names without an extension, directories, links and other non-regular
    members) start nothing: they belong to the sample whose run they sit in, or, before the
    first sample, to none (``off[0]`` is the first sample's first header). The last offset is
    where the end-of-archive marker begins, so trailing ignored members belong to the last
    sample. Parsing ``[off[a], off[b])`` as a stream without the marker
    (``accept_unterminated``) yields exactly samples ``a .. b-1``. A shard without samples
    gives one offset. Malformed input (and a duplicate field, as when reading) is
    ``FormatError``; so is a stream without the end-of-archive marker.
    """
    offsets: list[int] = []
    key: str | None = None
    fields: set[str] = set()
    walk = member_offsets(chunks, url, total=total)
    while True:  # TAR-PROGRESS: each turn takes the next member (or ends)
        try:
            path, start = next(walk)
        except StopIteration as stop:
            offsets.append(stop.value)
            return offsets
        parts = _sample_field(path)
        if parts is None:
            continue
        if parts[0] != key:
            key, fields = parts[0], set()
            offsets.append(start)
        elif parts[1] in fields:
            raise _duplicate(path, url, parts[0], parts[1])
        fields.add(parts[1])


def samples_from_chunks(chunks: Iterable[bytes], url: str = "", *, total: int | None = None,
                        accept_unterminated: bool = False,
                        on_unterminated: Callable[[], None] | None = None) -> Iterator[dict]:
    """Tar byte chunks -> WebDataset sample dicts of raw bytes (options: ``iter_members``)."""
    members = iter_members(chunks, url, total=total, accept_unterminated=accept_unterminated,
                           on_unterminated=on_unterminated)
    return group_samples(members, url)
