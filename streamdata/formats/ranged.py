"""A seekable binary file over ranged reads of one object: a decoder reads a large video's
index and the byte ranges its clip needs, never the whole object.

:class:`RangedFile` asks ``read_range(start, end)`` (a ranged GET, given by the dataset: this
module does no I/O of its own) for whole blocks of ``block`` bytes and keeps the last
``keep`` of them (a small read-ahead cache: a demuxer's many small reads of one region cost
one request). Reads that continue where the last one ended grow the next request, doubling
up to ``block * 8``, so a clip's run of frames goes in a few large requests, while a seek
elsewhere (an MP4's index at the object's end) starts small again. ``requests`` and
``bytes_read`` count what was asked for.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable

from streamdata.errors import FormatError

__all__ = ["BLOCK", "RangedFile"]

BLOCK = 64 * 1024  # the first request's size, and the cache's unit
_GROWTH = 8  # a sequential run's requests grow up to BLOCK * _GROWTH (512 KiB)


class RangedFile(io.RawIOBase):
    """Bytes ``[0, size)`` of one object, read by ``read_range(start, end)`` on demand."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int, *, name: str = "",
                 block: int = BLOCK, keep: int = 8) -> None:
        super().__init__()
        if size < 0 or block <= 0 or keep <= 0:
            raise ValueError(f"size, block and keep must be positive, got {size}, {block}, {keep}")
        self.name, self.size, self.block, self.keep = name, size, block, keep
        self._read_range = read_range
        self._pos = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()  # block number -> its bytes, LRU
        self._next_run = 1  # blocks the next request asks for (grows on sequential reads)
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
        run = self._next_run if number == self._last_end else 1
        self._next_run = min(run * 2, _GROWTH)
        last = min(number + run, -(-self.size // self.block))
        start, end = number * self.block, min(last * self.block, self.size)
        got = self._read_range(start, end)
        self.requests += 1
        self.bytes_read += len(got)
        for i in range(number, last):
            self._blocks[i] = got[(i - number) * self.block:(i - number + 1) * self.block]
            self._blocks.move_to_end(i)
        while len(self._blocks) > max(self.keep, last - number):
            self._blocks.popitem(last=False)
        self._last_end = last
        return self._blocks[number]
