"""Counters every reader adds to and any process can read: skips now, retries and more later.

Invariant (ONE-WRITER-PER-ROW): the counts live in one small int64 tensor in shared memory,
made with the dataset in the main process and handed to DataLoader workers with it (by fork,
or pickled as a shared-memory handle under spawn). Each reader adds only to its own row: the
main process (``num_workers=0``) to row 0, worker ``k`` to row ``k + 1``; within a process,
each counter is written by one thread only (skips by the reader's thread, retries by its I/O
thread). So increments never race, except for two live iterators of one non-persistent
DataLoader (their workers share ids): counts may then be short, never over. Reading sums
the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CACHE_EVENTS", "COUNTERS", "RESIGN_REASONS", "RETRY_REASONS", "SKIP_REASONS", "Counters"]

# why a record or unit was skipped under on_error (policy.skip_reason)
SKIP_REASONS = ("fetch", "timeout", "format", "decode", "other")
# why a request was tried again (client): 503 SlowDown / 429, other 5xx, a request past its
# time-out, a connection reset or refused, a body shorter than asked, anything else
RETRY_REASONS = ("throttled", "server", "timeout", "connection", "short", "other")
# the local disk cache (cache.py): items served from disk, items not found there (fetched and
# teed), entries evicted under cache_limit, entries found corrupt (deleted, re-fetched), and
# OSErrors (the first one of a process stops its writing to the cache)
CACHE_EVENTS = ("hits", "misses", "evictions", "corrupt", "errors")
# why a presigned S3 URL was signed again (store.presigned): it reached half its lifetime or
# its credentials' expiry ("age"), an answer said it or its token expired ("expired"), or a
# reused URL was refused once (credentials rotated: "refused")
RESIGN_REASONS = ("age", "expired", "refused")
# every counter a dataset keeps, readable as dataset.counts (and .skipped, .retried);
# planned.*: samples an exact epoch's plan repeats to keep ranks in step, or leaves out
# (drop_last), summed over epochs (streamdata.epoch.plan); resumed.reread: samples read again after a
# resume to reach the position inside a partly read unit (streamdata.epoch.resume); budget.grown: times a
# reader's byte budget grew (BUDGET-GROWTH, streamdata.fetch.budget)
COUNTERS = (*(f"skipped.{r}" for r in SKIP_REASONS), *(f"retried.{r}" for r in RETRY_REASONS),
            "accepted.unterminated", "planned.padded", "planned.left_out", "resumed.reread", "budget.grown",
            *(f"cache.{e}" for e in CACHE_EVENTS), *(f"resigned.{r}" for r in RESIGN_REASONS))

_ROWS = 65  # the main process and up to 64 workers per process; more share rows modulo


class Counters:
    """Named counters in shared memory, summed over this process and its DataLoader workers."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._table = torch.zeros((_ROWS, len(self.names)), dtype=torch.int64).share_memory_()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``name`` in this reader's row (see ONE-WRITER-PER-ROW)."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        row = 0 if info is None else 1 + info.id % (_ROWS - 1)
        self._table[row, self._index[name]] += n

    def snapshot(self, prefix: str = "") -> dict[str, int]:
        """Every counter's total so far, over all readers; with ``prefix`` (``"skipped."``),
        only those counters, named without it."""
        totals = self._table.sum(dim=0).tolist()
        return {name[len(prefix):]: n for name, n in zip(self.names, totals, strict=True)
                if name.startswith(prefix)}

    def reset(self) -> None:
        self._table.zero_()

    def __repr__(self) -> str:
        return f"Counters({self.snapshot()})"
