"""Compressed tar shards: gzip (``.tar.gz``, ``.tgz``) and zstd (``.tar.zst``) streamed into the parser.

:func:`decompressed` takes a shard's byte chunks as the prefetcher delivers them and yields the
tar stream, chunk by chunk, in the worker: parts are still fetched concurrently, and memory is
one compressed chunk plus at most :data:`OUT_CHUNK` bytes of output per step, whatever the
compression ratio (no decompression bomb: output is asked for in bounded pieces).

The format is chosen by the magic bytes (gzip ``1f 8b``, zstd ``28 b5 2f fd``), so a shard
named ``.tar`` that is gzip is read, and a ``.tgz`` that is a plain tar too; the suffix only
names what a stream too short to tell was meant to be. gzip streams may have several members
(``cat a.gz b.gz``, pigz, bgzip) and zstd several frames (and skippable frames).

gzip is inflated with ISA-L (``isal.isal_zlib``, faster than the standard library's zlib:
benchmarks/README.md, "Compressed shards and the shard writer"), zstd with ``zstandard``'s
bounded stream reader; a zstd stream is also walked frame by frame and block by block (headers
only), because the reader takes an input that stops mid-frame as a clean end: a truncated
``.tar.zst`` is an error, not a short shard.

Corrupt or truncated compressed data raises :class:`FormatError` naming the URL, the compressed
byte offset and what to do; trailing bytes after the last member/frame too (zero padding after a
gzip member is accepted, as ``gzip`` does).
"""

from __future__ import annotations

import types
import zlib
from collections.abc import Iterable, Iterator

from streamdata.errors import FormatError

__all__ = ["GZIP_MAGIC", "OUT_CHUNK", "TAR_SUFFIXES", "ZSTD_MAGIC", "codec_from_suffix", "decompressed",
           "sniff"]

TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
OUT_CHUNK = 1 << 20  # most decompressed bytes produced per step
_ZSTD_READ = 1 << 17  # compressed bytes the zstd reader takes per refill
_IN_STEP = 1 << 18  # compressed bytes handed to the inflater per call (its unconsumed tail is a copy)

_inflate_lib: types.ModuleType
_INFLATE_ERRORS: tuple[type[BaseException], ...]
try:  # ISA-L inflates faster than zlib (benchmarks/compressed.py)
    from isal import isal_zlib as _inflate_lib

    _INFLATE_ERRORS = (zlib.error, _inflate_lib.error)
except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
    _inflate_lib = zlib
    _INFLATE_ERRORS = (zlib.error,)


def codec_from_suffix(url: str) -> str | None:
    """``"gzip"``, ``"zstd"`` or ``None`` by the URL's suffix (a hint; the magic bytes decide)."""
    path = url.split("?", 1)[0].lower()
    if path.endswith((".gz", ".tgz")):
        return "gzip"
    if path.endswith((".zst", ".zstd")):
        return "zstd"
    return None


def sniff(head: bytes) -> str | None:
    """The compression the first bytes show: ``"gzip"``, ``"zstd"`` or ``None`` (plain)."""
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    return None


def decompressed(chunks: Iterable[bytes], url: str) -> tuple[Iterator[bytes], bool]:
    """``(tar chunks, compressed)``: the shard's bytes decompressed if its magic bytes say gzip
    or zstd, else as they came. Reads the first chunk(s), up to 4 bytes, to tell."""
    it = iter(chunks)
    head = b""
    while len(head) < len(ZSTD_MAGIC):
        chunk = next(it, None)
        if chunk is None:
            break
        head += chunk
    codec = sniff(head)
    if codec is None:
        hinted = codec_from_suffix(url)
        if hinted is not None and len(head) < len(ZSTD_MAGIC) and head:
            raise FormatError(f"truncated {hinted} shard {url}: only {len(head)} bytes (the object "
                              "is damaged or was cut short: write it again)", url=url)
        return _chain(head, it), False
    stream = _chain(head, it)
    return (_gunzip(stream, url) if codec == "gzip" else _unzstd(stream, url)), True


def _chain(head: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if head:
        yield head
    yield from rest


def _error(url: str, codec: str, offset: int, what: str) -> FormatError:
    return FormatError(f"corrupt {codec} shard {url}: {what} at compressed byte {offset} (the object "
                       "is damaged, truncated, or not what its magic bytes say: write it again, or "
                       "read with on_error='skip')", url=url)


def _gunzip(chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    """Inflate a (multi-member) gzip stream, at most ``OUT_CHUNK`` bytes per step."""
    inflater = _inflate_lib.decompressobj(wbits=31)
    offset = 0  # compressed bytes taken so far (for messages)
    member_has_input = False  # the inflater has been given input (an empty stream is no member)
    trailing_zeros = False
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            for at in range(0, len(view), _IN_STEP):
                data: bytes | memoryview = view[at:at + _IN_STEP]
                while data:  # each turn consumes input or produces output (bounded by OUT_CHUNK)
                    if trailing_zeros:
                        if bytes(data).count(0) != len(data):
                            raise _error(url, "gzip", offset, "data after zero padding")
                        offset += len(data)
                        break
                    if inflater.eof:  # the member ended: another member, padding, or garbage
                        if data[0] == 0:
                            trailing_zeros = True
                            continue
                        inflater = _inflate_lib.decompressobj(wbits=31)
                    before = len(data)
                    out = inflater.decompress(data, OUT_CHUNK)
                    member_has_input = True
                    data = inflater.unused_data if inflater.eof else inflater.unconsumed_tail
                    offset += before - len(data)
                    if out:
                        yield out
        if member_has_input and not inflater.eof:  # output the last call could not return
            tail = inflater.flush()
            if tail:
                yield tail
    except _INFLATE_ERRORS as exc:
        raise _error(url, "gzip", offset, f"{exc}") from None
    if member_has_input and not inflater.eof:
        raise FormatError(f"truncated gzip shard {url}: the compressed stream ends inside a member, "
                          f"after {offset} bytes (cut short in the upload? write it again)", url=url)


def _unzstd(chunks: Iterator[bytes], url: str) -> Iterator[bytes]:
    """Decompress a (multi-frame) zstd stream with bounded reads; the frame walker checks it is
    whole."""
    import zstandard

    source = _WalkedSource(chunks, url)
    reader = zstandard.ZstdDecompressor().stream_reader(  # a read()-able source, typed as IO[bytes]
        source, read_size=_ZSTD_READ, read_across_frames=True)  # type: ignore[arg-type]
    try:
        while True:  # each turn produces output or ends (the reader consumes input to produce)
            out = reader.read(OUT_CHUNK)
            if not out:
                break
            yield out
    except zstandard.ZstdError as exc:
        raise _error(url, "zstd", source.walker.offset, f"{exc}") from None
    source.walker.finish()


class _WalkedSource:
    """A ``read(n)`` file over the chunks, passing every byte through a :class:`_ZstdWalker`."""

    def __init__(self, chunks: Iterator[bytes], url: str) -> None:
        self._chunks = chunks
        self._buf = b""
        self._pos = 0  # bytes of _buf already read (no re-slicing of a big part per read)
        self.walker = _ZstdWalker(url)

    def read(self, n: int = -1) -> bytes:
        while self._pos >= len(self._buf):
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._buf, self._pos = chunk, 0
        start = self._pos
        end = len(self._buf) if n < 0 else min(len(self._buf), start + n)
        out = self._buf if start == 0 and end == len(self._buf) else self._buf[start:end]
        self._pos = end
        self.walker.feed(out)
        return out


class _ZstdWalker:
    """Follows zstd framing (frame headers, block headers, checksums, skippable frames) over
    the compressed bytes without decoding, to tell a stream that stops at a frame boundary
    from one cut short."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.offset = 0
        self.frames = 0
        self._state = "magic"
        self._need = 4  # bytes of the current field still to collect (or to skip)
        self._field = b""
        self._checksum = False

    def feed(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):  # each turn consumes at least one byte
            take = min(self._need, len(data) - pos)
            if self._state == "body":
                pos += take
                self._need -= take
            else:
                self._field += data[pos:pos + take]
                pos += take
                self._need -= take
            self.offset += take
            if self._need == 0:
                self._advance()

    def _advance(self) -> None:
        field, self._field = self._field, b""
        state = self._state
        if state == "body":
            self._after_skip()
        elif state == "magic":
            magic = int.from_bytes(field, "little")
            if field == ZSTD_MAGIC:
                self._state, self._need = "fhd", 1
            elif magic & 0xFFFFFFF0 == 0x184D2A50:
                self._state, self._need = "skipsize", 4
            else:
                raise _error(self.url, "zstd", self.offset - 4, "no zstd frame magic (trailing garbage?)")
        elif state == "skipsize":
            self._start_skip(int.from_bytes(field, "little"), then="magic")
        elif state == "fhd":
            fhd = field[0]
            fcs_flag, single, did_flag = fhd >> 6, (fhd >> 5) & 1, fhd & 3
            if fhd & 0x08:
                raise _error(self.url, "zstd", self.offset - 1, "a reserved bit set in a frame header")
            self._checksum = bool(fhd & 4)
            rest = (0 if single else 1) + (0, 1, 2, 4)[did_flag] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
            self._start_skip(rest, then="block")
        elif state == "block":
            header = int.from_bytes(field, "little")
            last, kind, size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise _error(self.url, "zstd", self.offset - 3, "a reserved block type")
            self._start_skip(1 if kind == 1 else size,
                             then=("checksum" if self._checksum else "end") if last else "block")

    def _start_skip(self, n: int, then: str) -> None:
        self._then = then
        if n:
            self._state, self._need = "body", n
        else:
            self._after_skip()

    def _after_skip(self) -> None:
        then = self._then
        if then == "block":
            self._state, self._need = "block", 3
        elif then == "checksum":
            self._then = "end"
            self._state, self._need = "body", 4
        else:  # "end" or "magic": a frame (or a skippable frame) is complete
            self.frames += then == "end"
            self._state, self._need = "magic", 4

    def finish(self) -> None:
        """At the end of the input: it must stop right after a whole frame."""
        if self._state == "magic" and self._need == 4 and not self._field and self.frames:
            return
        raise FormatError(f"truncated zstd shard {self.url}: the compressed stream ends inside a "
                          f"frame, after {self.offset} bytes (cut short in the upload? write it again)",
                          url=self.url)
