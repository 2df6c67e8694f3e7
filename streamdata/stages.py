"""Small generator stages that run inside the reader: error policy, shuffle buffer, batching."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .errors import SpecError, StreamDataError

__all__ = ["ErrorPolicy", "batched", "shuffled"]

T = TypeVar("T")
log = logging.getLogger("streamdata")


class ErrorPolicy:
    """What to do with a bad shard or sample: ``"raise"`` (default), ``"skip"`` (warn once per
    shard, count every skip) or a callable ``f(exc) -> bool`` (True: skip and go on)."""

    def __init__(self, policy: str | Callable[[BaseException], bool] = "raise") -> None:
        if not (callable(policy) or policy in ("raise", "skip", "warn")):
            raise SpecError(f"on_error must be 'raise', 'skip' or a callable, got {policy!r}")
        self.policy = policy
        self.skipped = 0

    def skip(self, exc: BaseException) -> bool:
        """True when ``exc`` is to be skipped (and counted); False to re-raise it."""
        if self.policy == "raise" or not isinstance(exc, (StreamDataError, OSError, ValueError)):
            return False
        go_on = bool(self.policy(exc)) if callable(self.policy) else True
        if go_on:
            self.skipped += 1
            log.warning("streamdata: skipped (%d so far): %s", self.skipped, exc)
        return go_on


def shuffled(items: Iterable[T], size: int, rng: random.Random) -> Iterator[T]:
    """A shuffle buffer of ``size`` items (0 or 1: pass through)."""
    if size <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        i = rng.randrange(size)
        buf[i], item = item, buf[i]
        yield item
    rng.shuffle(buf)
    yield from buf


def batched(items: Iterable[T], batch_size: int, collate: Callable[[list[T]], Any],
            drop_last: bool = False) -> Iterator[Any]:
    """Group items into lists of ``batch_size`` and collate each; the short tail unless drop_last."""
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) == batch_size:
            yield collate(batch)
            batch = []
    if batch and not drop_last:
        yield collate(batch)
