"""A list whose first entries can be let go while its indices stay absolute.

The prefetcher's items and plans (``fetch``): a persistent worker's prefetcher serves pass
after pass (NEXT-EPOCH-EARLY), and lets the passes before the current one go.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["Tail"]


class Tail:
    """A list whose first entries can be let go (``drop_before``); indices stay absolute."""

    def __init__(self, entries: Iterable) -> None:
        self.base = 0
        self._live = list(entries)

    def __len__(self) -> int:
        return self.base + len(self._live)

    def __getitem__(self, index: int) -> Any:
        if not self.base <= index < len(self):
            raise IndexError(f"entry {index} is not held (held: {self.base}..{len(self) - 1})")
        return self._live[index - self.base]

    def __setitem__(self, index: int, value: Any) -> None:
        self._live[index - self.base] = value

    def __iter__(self) -> Iterator:
        return iter(self._live)

    def extend(self, entries: Iterable) -> None:
        self._live.extend(entries)

    def drop_before(self, index: int) -> None:
        if index > self.base:
            del self._live[:index - self.base]
            self.base = index
