"""How an item's byte ranges are cut into the parts a reader requests, and which of them the
rest of the window waits for.

Optimisation (FIRST-BYTES-FIRST): a reader's first shard (sized, not a range of an index)
starts with a small part, each next one twice as big up to ``part_size``, and the rest of the
window waits, at most FIRST_HOLD_MAX_S, until the parts that start in its first
FIRST_HOLD_BYTES (by default 256 KiB, 512 KiB, 1 MiB, 2 MiB: 3.75 MiB, a first batch) have
arrived. Sent beside the window, those parts would share the server's (or the link's)
bandwidth with every request in flight. The wait is short on purpose: it matters where those
parts arrive fast (a short round trip); beyond it, the window's new connections (two round
trips) keep their bytes behind them anyway, and a longer wait only delays the window. The wait
holds no reference to their bytes (BYTE-BUDGET, ``fetch``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamdata.fetch.tune import Held

__all__ = ["FIRST_HOLD_BYTES", "FIRST_HOLD_MAX_S", "Part", "Range", "first_parts", "split_parts"]

Range = tuple[int, int | None]  # [start, end) in bytes; end None = to the end of the object

FIRST_HOLD_BYTES = 2 << 20
FIRST_HOLD_MAX_S = 0.1


@dataclasses.dataclass(eq=False, slots=True, weakref_slot=True)
class Part:
    """One of an item's parts, the bytes one request asks for: the scheduler sends it, the reader
    waits on its future, and each drops it as soon as it is done with it (BYTE-BUDGET); its bytes
    are its future's result, never a field of its own."""

    range: Range  # the bytes it asks for
    need: int  # the bytes it reserves of the budget: an open-ended part, the part size it was cut at
    future: concurrent.futures.Future = dataclasses.field(
        default_factory=concurrent.futures.Future)  # its bytes (or error), for the reader
    held: Held | None = None  # once arrived: the knobs that held it back when sent (AUTOTUNE); None: none
    latency: float | None = None  # once arrived, with ``held``: its first byte's wait in seconds, if told
    reserved_fix: int = 0  # once arrived: its real size less ``need`` (an open-ended part's)

    @classmethod
    def cut(cls, part: Range, part_size: int) -> Part:
        """The part for range ``part``, one ``split_parts`` cut at ``part_size`` (what an
        open-ended one reserves)."""
        start, end = part
        return cls(part, (end if end is not None else start + part_size) - start)


class Arrivals:
    """Whether the parts that start in an item's first FIRST_HOLD_BYTES have all arrived
    (FIRST-BYTES-FIRST); holds no reference to their bytes (BYTE-BUDGET)."""

    def __init__(self, futures: list[concurrent.futures.Future]) -> None:
        self._count = len(futures)
        self._arrived: list[None] = []  # appended by a callback on any thread: atomic
        for fut in futures:
            fut.add_done_callback(lambda _: self._arrived.append(None))

    @property
    def count(self) -> int:
        """How many parts it watches."""
        return self._count

    @property
    def done(self) -> bool:
        return len(self._arrived) >= self._count


def first_parts(todo: collections.deque[Part]) -> Arrivals:
    """Watch ``todo``'s parts that start in its first FIRST_HOLD_BYTES."""
    futures, at = [], 0
    for part in todo:
        if at >= FIRST_HOLD_BYTES:
            break
        futures.append(part.future)
        start, end = part.range
        at += FIRST_HOLD_BYTES if end is None else end - start
    return Arrivals(futures)


def split_parts(ranges: Sequence[Range], part_size: int, first_part: int | None = None) -> list[Range]:
    """Cut ranges into parts of at most ``part_size``; with ``first_part``, the parts start at
    that size and double up to ``part_size`` (the first batch needs only the first bytes)."""
    parts: list[Range] = []
    size = min(first_part or part_size, part_size)
    for start, end in ranges:
        if end is None:
            parts.append((start, None))
            continue
        while start < end:
            parts.append((start, min(start + size, end)))
            start += size
            size = min(size * 2, part_size)
    return parts
