"""Counters every reader adds to and any process can read: skips, retries, and each reader's
stage timings (``READER_STATS``, kept by :class:`StageClock`).

Invariant (ONE-WRITER-PER-ROW): the counts live in one small int64 tensor in shared memory,
made with the dataset in the main process and handed to DataLoader workers with it (by fork,
or pickled as a shared-memory handle under spawn). Each reader adds only to its own row: the
main process (``num_workers=0``) to row 0, worker ``k`` to row ``k + 1``; within a process,
each counter is written by one thread only (skips by the reader's thread, retries by its I/O
thread; ``add_many`` reads and writes only the columns it names). So increments never race,
except for two live iterators of one non-persistent DataLoader (their workers share ids):
counts may then be short, never over. Reading sums the rows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["CACHE_EVENTS", "COUNTERS", "KNOBS", "MODALITIES", "READER_STATS", "RESIGN_REASONS",
           "RETRY_REASONS", "SKIP_REASONS", "STAGES", "Consumed", "Counters", "StageClock", "batch_len",
           "decode_timing", "modality_acc"]

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
# (drop_last), summed over epochs (streamdata.epoch.plan); batched.left_out: samples drop_last left out
# in a reader's last short batch where no plan sized its batches (without counts: this rank's readers',
# summed over epochs; streamdata.batch.batches); resumed.reread: samples read again after a
# resume to reach the position inside a partly read unit (streamdata.epoch.resume); budget.grown: times a
# reader's byte budget grew (BUDGET-GROWTH, streamdata.fetch.budget); tokens.*: an sd.TokenDataset epoch's
# final partial sequence, its tokens dropped or the padding added, and the tails of documents longer than
# a sequence that packing "best_fit" leaves out (TOKENS-ONCE, streamdata.epoch.tokens);
# tuned.*: times a reader's window, request limit or part size moved (AUTOTUNE, streamdata.fetch.tune);
# paced.requests: requests that waited for their slot under a request rate (RATE-SHARE, streamdata.store.rate)
COUNTERS = (*(f"skipped.{r}" for r in SKIP_REASONS), *(f"retried.{r}" for r in RETRY_REASONS),
            "accepted.unterminated", "planned.padded", "planned.left_out", "batched.left_out",
            "resumed.reread", "budget.grown", "tokens.dropped", "tokens.padded", "tokens.truncated",
            "tuned.window", "tuned.max_requests", "tuned.part_size", "paced.requests",
            *(f"cache.{e}" for e in CACHE_EVENTS), *(f"resigned.{r}" for r in RESIGN_REASONS))

# where a reader's time goes (``StageClock``): waiting for bytes (the prefetcher's waits, disk
# reads of cached items), parsing (tar / Parquet bytes -> records, decompression included),
# decoding (``prepare``: fields by extension, Arrow -> tensors), the dataset's ``map``, and
# collating: the rest of the reader's work (batching, the shuffle buffer, positions)
STAGES = ("wait_bytes", "parse", "decode", "map", "collate")
# what ``decode`` holds per kind of field (parts of it, not stages of their own: their sum is at
# most ``decode``): images (an image transform, or ``decode=True``'s image fields), video and audio
# (``sd.video`` / ``sd.audio`` transforms); the rest of ``decode`` is the other fields
MODALITIES = ("image", "video", "audio")
# a table of its own beside COUNTERS (ONE-WRITER-PER-ROW too), in integer nanoseconds and counts:
# per reader, samples and batches yielded; wall_ns, time from each pass's start to its last
# flush; busy_ns, time inside the pass's ``next()`` of a batch or sample (the stages add up to
# it); decode_<modality>_ns, the parts of decode_ns spent on each kind of field (MODALITIES); the
# prefetcher's parts fetched (``requests``, written by the reader's I/O thread), their bytes
# and first-byte latency (summed over ``first_bytes`` parts whose backend tells it); knob.*: the
# reader's prefetcher's knobs now (AUTOTUNE, streamdata.fetch.tune; written as changes by its I/O
# thread, taken back when it closes: 0 between passes)
KNOBS = ("window", "max_requests", "byte_budget", "part_size")  # a prefetcher's (AUTOTUNE)
READER_STATS = ("samples", "batches", "wall_ns", "busy_ns", *(f"{s}_ns" for s in STAGES),
                *(f"decode_{m}_ns" for m in MODALITIES),
                "requests", "bytes", "first_byte_ns", "first_bytes",
                *(f"knob.{k}" for k in KNOBS))

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

        self._table[_row(get_worker_info()), self._index[name]] += n

    def add_many(self, counts: Mapping[str, int]) -> None:
        """Add each of ``counts`` in this reader's row, in one write (ONE-WRITER-PER-ROW)."""
        from torch.utils.data import get_worker_info

        # only the named columns are read and written: another thread's columns in this row
        # (the I/O thread's ``requests``, the reader's stage times) are never written back stale
        index = torch.tensor([self._index[name] for name in counts], dtype=torch.int64)
        self._table[_row(get_worker_info())].index_add_(0, index, torch.tensor(list(counts.values()),
                                                                               dtype=torch.int64))

    def rows(self) -> list[dict[str, int]]:
        """Each row that any reader wrote to, as its own counts (row 0: the main process)."""
        return [dict(zip(self.names, row, strict=True)) for row in self._table.tolist() if any(row)]

    @staticmethod
    def merged_rows(tables: Sequence[Counters], most: Sequence[str] = ()) -> list[dict[str, int]]:
        """Row by row over ``tables`` with the same names (one reader's row in each): the sum,
        or for the names in ``most`` the largest; the rows any reader wrote to."""
        if not tables:
            return []
        stacked = torch.stack([t._table for t in tables])
        merged = stacked.sum(dim=0)
        for name in most:
            i = tables[0]._index[name]
            merged[:, i] = stacked[:, :, i].max(dim=0).values
        names = tables[0].names
        return [dict(zip(names, row, strict=True)) for row in merged.tolist() if any(row)]

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


class Consumed:
    """Counters of a table as of the batches the loop received (CONSUMED-POSITION in
    ``feed/checkpoint``): each batch carries its reader's row as it left the reader (:meth:`tag`,
    in the reader); ``sd.loader`` hands that to :meth:`deliver` when the step consumes the batch,
    and :meth:`end` takes in what the readers counted after their last batch once the epoch's
    iteration has ended. What readers counted ahead of the loop (prefetched batches, a pass
    ended in a worker) is not counted until delivered, and not at all where the iteration is left
    before (a resume reads it again). Only the main process calls :meth:`begin`, :meth:`deliver`,
    :meth:`end` and reads the totals."""

    def __init__(self, table: Counters) -> None:
        self.table = table
        self.totals = table._table.sum(dim=0).tolist()  # (what was counted before, as it stands)
        self._seen = table._table.tolist()  # per row: what is counted already, or passed over

    def tag(self) -> tuple[int, list[int]]:
        """This reader's row and its counts now (in the reader: ONE-WRITER-PER-ROW)."""
        from torch.utils.data import get_worker_info

        row = _row(get_worker_info())
        return row, self.table._table[row].tolist()

    def begin(self) -> None:
        """An iteration starts its readers: what they counted before it (a pass left early, its
        batches never received) is passed over."""
        self._seen = self.table._table.tolist()

    def deliver(self, row: int, counts: Sequence[int]) -> None:
        """A batch whose reader's row read ``counts`` when it left the reader was received."""
        seen = self._seen[row]
        self.totals = [t + max(c - s, 0) for t, c, s in zip(self.totals, counts, seen, strict=True)]
        self._seen[row] = [max(c, s) for c, s in zip(counts, seen, strict=True)]

    def end(self) -> None:
        """The epoch's iteration ended: every reader's pass, to its end, was received."""
        for row, counts in enumerate(self.table._table.tolist()):
            self.deliver(row, counts)

    def snapshot(self) -> dict[str, int]:
        return dict(zip(self.table.names, self.totals, strict=True))


def _row(info: Any) -> int:
    """This reader's row: 0 in the main process, ``1 + worker id`` in a DataLoader worker."""
    return 0 if info is None else 1 + info.id % (_ROWS - 1)


class StageClock:
    """One reader's pass's stage times (``STAGES``), in plain ints in ``acc``, flushed into the
    shared ``READER_STATS`` table at most every ``FLUSH_NS`` and when the pass ends.

    Only the reader's thread touches ``acc``. The prefetcher adds its waits for bytes (``WAIT``,
    exact); ``ErrorPolicy.each`` adds the pull of each record less the waits within it
    (``PARSE``), its ``prepare`` (``DECODE``) and its ``map`` (``MAP``); the pass's iterator
    adds each batch's or sample's whole ``next()`` (``BUSY``). Within ``DECODE``, the decoder
    adds each field's time to its modality's slot (``IMAGE``, ``VIDEO``, ``AUDIO``;
    :func:`decode_timing`).

    Each flush takes nested times apart: collating is what ``BUSY`` holds beyond the waits,
    parsing, decoding and ``map``; where the stages' sum exceeds a batch's measured busy time
    (each is read on its own clock), they are scaled to it, the modalities with ``decode``.
    """

    WAIT, PARSE, DECODE, MAP, BUSY, SAMPLES, BATCHES, IMAGE, VIDEO, AUDIO = range(10)
    MODALITY = {"image": IMAGE, "video": VIDEO, "audio": AUDIO}  # MODALITIES' slots in ``acc``
    FLUSH_NS = 20_000_000

    __slots__ = ("_last", "acc", "table")

    def __init__(self, table: Counters) -> None:
        self.table = table
        self.acc = [0] * 10
        self._last = time.perf_counter_ns()  # the pass's start, then the last flush

    def due(self, now: int) -> bool:
        return now - self._last >= self.FLUSH_NS

    def flush(self, now: int | None = None) -> None:
        """What the pass did since the last flush, into this reader's row of the table."""
        now = time.perf_counter_ns() if now is None else now
        wait, parse, decode, mapped, busy, samples, nbatches, *kinds = self.acc
        self.acc[:] = [0] * 10
        wall = now - self._last
        estimated, room = parse + decode + mapped, max(0, busy - wait)
        if estimated > room:  # the stages, each on its own clock, over what was measured: scaled to it
            kinds = [k * room // estimated for k in kinds]
            parse, decode, mapped = (parse * room // estimated, decode * room // estimated,
                                     mapped * room // estimated)
        within = sum(kinds)
        if within > decode:  # each field's time is read inside decode's: never more than it
            kinds = [k * decode // within for k in kinds]
        self.table.add_many({
            "samples": samples, "batches": nbatches, "wall_ns": wall, "busy_ns": busy,
            "wait_bytes_ns": wait, "parse_ns": parse, "decode_ns": decode, "map_ns": mapped,
            "collate_ns": max(0, busy - wait - parse - decode - mapped),
            **{f"decode_{m}_ns": k for m, k in zip(MODALITIES, kinds, strict=True)}})
        self._last = now


_decoding = threading.local()  # .acc: a pass's clock's, while this thread decodes (``decode_timing``)


def decode_timing(acc: list[int] | None) -> list[int] | None:
    """Set the ``acc`` that a decoder on this thread adds its per-field times to (a pass's
    clock's, or None), giving back the one set before (to set again after). The reader's thread
    sets it around its ``prepare`` only, so a decode thread (``decode_threads > 1``) finds none
    and times nothing: ``acc`` keeps its one writer (ONE-WRITER-PER-ROW)."""
    before = getattr(_decoding, "acc", None)
    _decoding.acc = acc
    return before


def modality_acc() -> list[int] | None:
    """The ``acc`` a decoder on this thread adds its per-field times to (``StageClock.IMAGE``,
    ``VIDEO``, ``AUDIO``), or None where nothing is timed."""
    return getattr(_decoding, "acc", None)


def batch_len(batch: Any) -> int:
    """Samples in ``batch``: the length of its first field (a tensor, array or list), found in
    nested dicts and tuples (a list is a field, or a list of samples); 1 for a batch with no
    such field."""
    while True:
        if isinstance(batch, Mapping):
            batch = next(iter(batch.values()), None)
        elif isinstance(batch, tuple) and batch:
            batch = batch[0]
        elif isinstance(batch, (str, bytes)) or batch is None:
            return 1
        else:
            try:
                return len(batch) if not isinstance(batch, torch.Tensor) or batch.dim() else 1
            except TypeError:
                return 1
