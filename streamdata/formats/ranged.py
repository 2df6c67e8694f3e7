"""A seekable binary file over ranged reads of one object: a decoder reads a large video's
index and the byte ranges its clip needs, never the whole object.

:class:`RangedFile` asks ``read_ranges([(start, end), ...])`` (ranged GETs sent together, given
by the dataset: this module does no I/O of its own) for whole blocks of ``block`` bytes and
keeps the last ``keep`` of them (a small cache: a demuxer's many small reads of one region cost
one request). A read elsewhere (a seek: an MP4's index at the object's end) asks for one block.
A read that continues where the last fetch ended is a sequential run (a clip's frames): each
such round fetches 16 times the blocks of the one before (1 MiB after a 64 KiB block), up to
``read_ahead`` bytes, in requests of up to ``block * 8`` sent together, at most ``in_flight``
of them; the decoder waits for the round's requests together (about one round trip), not one
after another, and reads at most one round ahead of its last read. With
``read_ahead=0`` a run's requests go one at a time, doubling up to ``block * 8``.
``requests`` and ``bytes_read`` count what was asked for.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable, Sequence

from streamdata.errors import FormatError

__all__ = ["BLOCK", "IN_FLIGHT", "READ_AHEAD", "RangedFile"]

BLOCK = 64 * 1024  # the first request's size, and the cache's unit
_GROWTH = 8  # a request asks for up to BLOCK * _GROWTH (512 KiB)
_AHEAD_GROWTH = 16  # a run's rounds (read_ahead): 1 block, then 16 (1 MiB), then read_ahead
READ_AHEAD = 2 * 1024 * 1024  # the most bytes one round of a sequential run fetches
IN_FLIGHT = 4  # the most requests one round sends together


class RangedFile(io.RawIOBase):
    """Bytes ``[0, size)`` of one object, read by ranged requests on demand: ``read_range(start,
    end)`` one at a time, or ``read_ranges(ranges)`` (a list of bytes, in order) several at once."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int, *, name: str = "",
                 block: int = BLOCK, keep: int = 8,
                 read_ranges: Callable[[Sequence[tuple[int, int]]], Sequence[bytes]] | None = None,
                 read_ahead: int = READ_AHEAD, in_flight: int = IN_FLIGHT) -> None:
        super().__init__()
        if size < 0 or block <= 0 or keep <= 0 or read_ahead < 0 or in_flight <= 0:
            raise ValueError(f"size, block, keep, read_ahead and in_flight must be positive, got {size}, "
                             f"{block}, {keep}, {read_ahead}, {in_flight}")
        self.name, self.size, self.block, self.keep = name, size, block, keep
        self.read_ahead, self.in_flight = read_ahead, in_flight
        self._read_range = read_range
        self._read_ranges = read_ranges
        self._pos = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()  # block number -> its bytes, LRU
        self._next_run = 1  # blocks the next sequential round asks for (grows on each)
        self._last_end = -1  # the block after the last one fetched
        self.requests = 0
        self.bytes_read = 0

    # ---- io.RawIOBase ------------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(base + offset, 0)
        return self._pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        want = min(len(view), max(self.size - self._pos, 0))
        done = 0
        while done < want:
            number, within = divmod(self._pos + done, self.block)
            data = self._block(number)
            n = min(len(data) - within, want - done)
            if n <= 0:
                raise FormatError(f"{self.name}: the object ended at {self._pos + done} of {self.size} bytes",
                                  url=self.name or None)
            view[done:done + n] = data[within:within + n]
            done += n
        self._pos += done
        return done

    # ---- the cache ---------------------------------------------------------------------------
    def _block(self, number: int) -> bytes:
        data = self._blocks.get(number)
        if data is not None:
            self._blocks.move_to_end(number)
            return data
        total = -(-self.size // self.block)
        if self.read_ahead:  # a run seen: rounds of up to read_ahead bytes, sent together
            most = max(_GROWTH, self.read_ahead // self.block)
            run = min(self._next_run, most) if number == self._last_end else 1
            self._next_run = min(run * _AHEAD_GROWTH, most)
            step = _GROWTH
        else:  # one request at a time, doubling up to _GROWTH blocks
            run = self._next_run if number == self._last_end else 1
            self._next_run = min(run * 2, _GROWTH)
            step = run
        last = min(number + run, total)
        spans = [(b, min(b + step, last)) for b in range(number, last, step)][:self.in_flight]
        last = spans[-1][1]
        ranges = [(b * self.block, min(e * self.block, self.size)) for b, e in spans]
        if len(ranges) == 1 or self._read_ranges is None:
            gots = [self._read_range(start, end) for start, end in ranges]
        else:
            gots = list(self._read_ranges(ranges))
        self.requests += len(ranges)
        for (first, _), got in zip(spans, gots, strict=True):
            self.bytes_read += len(got)
            for i in range(first, first + -(-len(got) // self.block)):
                self._blocks[i] = got[(i - first) * self.block:(i - first + 1) * self.block]
                self._blocks.move_to_end(i)
        while len(self._blocks) > max(self.keep, last - number):
            self._blocks.popitem(last=False)
        self._last_end = last
        data = self._blocks.get(number)
        return b"" if data is None else data
