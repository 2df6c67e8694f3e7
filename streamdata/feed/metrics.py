"""Is the GPU waiting? The training loop's side of ``loader.metrics()`` and ``sd.timed``.

:class:`Stopwatch` times each ``next()`` the training loop makes on a loader: how long it was
blocked (``data_wait_s``) against the wall time of the passes (``wall_s``), whose ratio is the
stall fraction. :func:`summary` adds what the readers accounted in their shared table
(``metrics.READER_STATS``, summed over workers: ONE-WRITER-PER-ROW), the dataset's counters and
the GPU feed's pinning and copies, into one flat dict, with a one-line ``verdict`` when the loop
waits. :func:`gather_ranks` gathers every rank's dict (a collective over the gloo group).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from streamdata.metrics import KNOBS, MODALITIES, STAGES
from streamdata.ranks import gloo_group, multi_rank

__all__ = ["STALLED", "Stopwatch", "Timed", "gather_ranks", "summary", "verdict"]

log = logging.getLogger("streamdata")

STALLED = 0.1  # a stall fraction above this gets a verdict
BUSY = 0.5  # readers working this share of their time or more, the loop waiting: CPU-bound
_NS = 1e-9

Metrics = dict[str, Any]  # str -> int | float | str | None, JSON-ready


class Stopwatch:
    """The time each ``next()`` on the wrapped passes blocked, and the passes' wall time.

    A pass's wall time runs from the start of its first ``next()`` to its end (or now, while
    it runs); the loader's very first batch is the exception: its wait is ``first_batch_s``
    (workers starting, the first bytes) and the wall starts when it is delivered. Time between
    passes (an evaluation between epochs) is in neither. ``report(steps)`` runs every ``every``
    steps, after the step's batch arrived and before the loop gets it.
    """

    def __init__(self, every: int = 0, report: Callable[[int], None] | None = None) -> None:
        self.every, self.report = every, report
        self.steps = 0
        self.wait_ns = 0
        self.first_batch_ns: int | None = None
        self._done_ns = 0  # the wall time of the passes that ended
        self._since: int | None = None  # where the live pass's wall time starts

    def wrap(self, source: Iterator[Any]) -> Iterator[Any]:
        """``source``'s items, each ``next()`` timed."""
        clock = time.perf_counter_ns
        try:
            while True:
                start = clock()
                if self._since is None and self.first_batch_ns is not None:
                    self._since = start  # a later pass: its wall starts with its first wait
                try:
                    item = next(source)
                except StopIteration:
                    self.wait_ns += clock() - start
                    return
                now = clock()
                if self.first_batch_ns is None:
                    self.first_batch_ns, self._since = now - start, now
                else:
                    self.wait_ns += now - start
                self.steps += 1
                if self.every and self.report is not None and self.steps % self.every == 0:
                    self.report(self.steps)
                yield item
        finally:
            if self._since is not None:
                self._done_ns += clock() - self._since
                self._since = None

    def snapshot(self) -> Metrics:
        """``steps``, ``wall_s``, ``data_wait_s``, ``first_batch_s`` and ``stall_fraction``."""
        wall = self._done_ns + (time.perf_counter_ns() - self._since if self._since is not None else 0)
        return {"steps": self.steps, "wall_s": wall * _NS, "data_wait_s": self.wait_ns * _NS,
                "first_batch_s": (self.first_batch_ns or 0) * _NS,
                "stall_fraction": min(1.0, self.wait_ns / wall) if wall > 0 else 0.0}


def readers(dataset: Any) -> list[dict[str, int]]:
    """Each reader's stage table (``ShardedDataset.reader_stats``), or none for other datasets."""
    stats = getattr(dataset, "reader_stats", None)
    return stats() if callable(stats) else []


def summary(watch: Stopwatch, dataset: Any = None, feed: Any = None) -> Metrics:
    """The flat dict ``loader.metrics()`` returns (docs/metrics.md)."""
    out = watch.snapshot()
    rows = readers(dataset)
    total = {name: sum(row[name] for row in rows) for name in rows[0]} if rows else {}
    if rows:
        out["readers"] = len(rows)
        out["samples"] = total["samples"]
        out["batches"] = total["batches"]
        out["bytes"] = total["bytes"]
        out["requests"] = total["requests"]
        parts = total["first_bytes"]
        out["first_byte_s"] = total["first_byte_ns"] / parts * _NS if parts else 0.0  # the mean
        out["readers.wall_s"] = total["wall_ns"] * _NS
        out["readers.busy_s"] = total["busy_ns"] * _NS
        for stage in STAGES:
            out[f"stage.{stage}_s"] = total[f"{stage}_ns"] * _NS
        for kind in MODALITIES:  # parts of stage.decode_s: their sum is at most it
            out[f"stage.decode_{kind}_s"] = total[f"decode_{kind}_ns"] * _NS
        for knob in KNOBS:  # AUTOTUNE: the largest of the readers' knobs now (0 between passes)
            out[f"knob.{knob}"] = max(row[f"knob.{knob}"] for row in rows)
    counts = getattr(dataset, "counts", None)
    if isinstance(counts, dict):
        out["retries"] = sum(n for name, n in counts.items() if name.startswith("retried."))
        out.update({name: n for name, n in counts.items() if name not in out})
    if feed is not None:
        out.update({f"feed.{name}": value for name, value in feed.times().items()})
    out["verdict"] = verdict(out)
    return out


def verdict(m: Metrics) -> str | None:
    """One line on why the loop waits (stall fraction above ``STALLED``), else None: I/O-bound
    when the readers' waits for bytes outweigh their own work; CPU-bound when their work is
    ``BUSY`` of their time or more; else the hand-off: readers idle much of their time while
    the loop waits."""
    if m.get("stall_fraction", 0.0) <= STALLED:
        return None
    wall = m.get("readers.wall_s", 0.0)
    if not wall:
        return (f"the loop waits {m['stall_fraction']:.0%} of the time for data "
                "(no stage timings for this dataset)")
    waiting = m["stage.wait_bytes_s"]
    working = sum(m[f"stage.{stage}_s"] for stage in STAGES if stage != "wait_bytes")
    if waiting >= working:
        return (f"I/O-bound: workers wait for bytes {waiting / wall:.0%} of their time: "
                "raise window/max_requests or move closer to the bucket")
    if working >= BUSY * wall:
        return (f"CPU-bound: workers are {working / wall:.0%} busy decoding: "
                "more workers or a lighter map")
    return (f"hand-off-bound: workers are only {working / wall:.0%} busy and wait for bytes "
            f"{waiting / wall:.0%} of their time, yet the loop waits: the main process's share of "
            "each batch (receiving it, pinning and copying it) or batches coming unevenly: "
            "a larger prefetch_factor, or fewer bytes per batch")


def gather_ranks(mine: Metrics) -> Metrics:
    """Every rank's dict, with its ``rank`` (a collective: call it on every rank over the gloo
    group, ``ranks.gloo_group``), and the straggler: the rank that waited longest for data. In a
    single process, this one's."""
    if multi_rank():
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {**mine, "rank": dist.get_rank()}, group=gloo_group())
    else:
        gathered = [{**mine, "rank": 0}]
    straggler = max(range(len(gathered)), key=lambda r: gathered[r].get("data_wait_s", 0.0))
    return {"ranks": gathered, "straggler": straggler,
            "straggler_data_wait_s": gathered[straggler].get("data_wait_s", 0.0)}


def reporter(every: int | None, on_metrics: Callable[[Metrics], None] | None,
             metrics: Callable[[], Metrics]) -> Callable[[int], None] | None:
    """What runs every ``every`` steps: ``on_metrics(metrics())``, or a line on the streamdata
    logger at INFO when no callback is given."""
    if not every:
        return None

    def report(steps: int) -> None:
        m = metrics()
        if on_metrics is not None:
            on_metrics(m)
            return
        log.info("streamdata: step %d: waited for data %.1f%% of %.1f s%s", steps,
                 100 * m["stall_fraction"], m["wall_s"], f"; {m['verdict']}" if m["verdict"] else "")
        log.debug("streamdata metrics: %s", json.dumps(m))

    return report


class Timed:
    """``sd.timed(iterable)``: ``iterable`` (a DataLoader, any iterable) with each ``next()``
    timed; :meth:`metrics` as ``loader.metrics()``'s, with stage timings when the iterable is
    (or its ``dataset`` is) a streamdata dataset."""

    def __init__(self, iterable: Iterable[Any], *, log_every: int | None = None,
                 on_metrics: Callable[[Metrics], None] | None = None) -> None:
        self.iterable = iterable
        self.dataset = getattr(iterable, "dataset", iterable)
        self.stopwatch = Stopwatch(log_every or 0, reporter(log_every, on_metrics, self.metrics))

    def __iter__(self) -> Iterator[Any]:
        return self.stopwatch.wrap(iter(self.iterable))

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def metrics(self, all_ranks: bool = False) -> Metrics:
        mine = summary(self.stopwatch, self.dataset)
        return gather_ranks(mine) if all_ranks else mine
