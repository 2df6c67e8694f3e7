"""The block shuffle: a stateless seeded shuffle of an exact epoch's span (BLOCK-SHUFFLE). Pure, no I/O.

With every unit's sample count known (a tar index with offsets, Parquet footers, Arrow IPC
files), a reader's span (``plan``) is cut into *pieces*; the pieces are read in a seeded order,
taken in turn into *windows* of at most ``window`` samples (``PIECES`` pieces each, from seeded
places of the span), and each window's samples are put out in a seeded permutation. The order is
a pure function of ``(seed, epoch, world, span)`` and the number of samples put out so far, so
the position alone restores it:

- a piece is ``[a, b)`` of the span's own samples (the plan's repeated ``pad`` samples, if any,
  come last, unshuffled). Tar with offsets: fixed cuts of ``window / PIECES`` samples, each read
  with one ranged GET (two where it crosses a shard); formats whose unit is fetched whole (Parquet
  row groups, Arrow record batches): runs of whole segments of at most that (a bigger segment is
  a piece, and a window, of its own), so no unit is fetched twice;
- the pieces' order: ``rng([*reader_seed, TAG]).permutation``; window ``j``'s samples, as read
  (piece by piece): ``rng([*reader_seed, TAG, j + 1]).permutation`` (numpy's default generator).
  Pieces from 16 places make neighbours unlike each other even where the shards were written in
  label order (contiguous windows keep that order inside a window: benchmarks/README.md, "Shuffle quality");
- RESUME-CONTINUES: ``d`` delivered = windows ``[0, j)`` whole and the first ``r`` of window
  ``j``'s permutation: the resumed pass reads window ``j`` again (``r`` samples read again,
  counted in ``resumed.reread``), drops those ``r``, and goes on with window ``j + 1``;
- RESUME-ELASTIC: :func:`block_runs` says which runs of an old reader's span its first ``d``
  samples left out (window arithmetic, O(span)); ``resume`` re-divides them.

READ-SPREAD: the next window is read while one is put out, a share before each sample, so a
reader's work comes evenly, not in a burst at each window's start. Memory: about one window of
samples held (the rest of the one put out and the read share of the next; plus the
prefetcher's byte budget). A state saved under the
block shuffle carries ``"shuffle": "block:<window>"``; a pass that shuffles otherwise refuses it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from streamdata.epoch.plan import Segment, Span
from streamdata.epoch.resume import Stage
from streamdata.epoch.sharding import reader_seed
from streamdata.epoch.world import World
from streamdata.errors import SpecError

__all__ = ["MAX_WINDOW", "MIN_WINDOW", "PIECES", "WINDOW_BYTES", "Windows", "block_reads", "block_runs",
           "block_shuffled", "check_mode", "check_shuffle_option", "delivered_mask", "mode_tag", "window_for",
           "window_spans", "windows_of", "with_mode"]

MIN_WINDOW, MAX_WINDOW = 64, 65536  # samples, the default window's bounds
# ORDER-NOT-IO: the default window's encoded bytes, fixed (half the default byte budget,
# ``config.FetchConfig``), never the live fetch settings: the data order, and so a saved state,
# stays the same whatever byte_budget, STREAMDATA_BYTE_BUDGET or autotune a run or its restart uses
WINDOW_BYTES = 32 * 2**20
PIECES = 16  # a window gathers this many pieces of the span, from seeded places
TAG = 0xB10C  # seed material that sets the block shuffle's generators apart
MODES = ("block", "buffer")


@dataclass(frozen=True)
class Windows:
    """How a pass puts out what it reads (reads in this order, window after window): ``sizes[i]``
    samples of window ``keys[i]``, permuted; the first ``skip`` put out are dropped (delivered
    before a resume); then whatever follows (the plan's ``pad``), as it comes."""

    material: tuple[int, ...]
    sizes: tuple[int, ...]
    keys: tuple[int, ...]
    skip: int = 0
    tables: bool = False


def window_for(ds: Any) -> int | None:
    """The dataset's block window in samples, or None where it shuffles with a buffer (or not at
    all). ``shuffle="block"`` needs sample counts; ``shuffle=True`` takes the block shuffle when
    the counts are known, the units' samples can be read apart (``ranged_segments``, or records
    that are tables) and no ``shuffle_buffer`` was given."""
    if not ds.shuffle:
        return None
    mode = ds.shuffle_mode
    counts = ds.sample_counts()
    if mode is None:
        able = counts is not None and (ds.records_are_tables or ds.ranged_segments())
        mode = "block" if able and not ds.buffer_given else "buffer"
    if mode == "buffer":
        return None
    if counts is None:
        raise SpecError(f"shuffle='block' needs every unit's sample count ({type(ds).__name__}: a tar "
                        "sample index, Parquet without a filter, Arrow IPC files): build the index "
                        "(streamdata index SPEC) or use shuffle='buffer'")
    if ds.shuffle_window is not None:
        return int(ds.shuffle_window)
    total = int(np.sum(counts))
    mean = sum(int(s.size) for s in ds.shards) / max(total, 1)
    return int(min(max(WINDOW_BYTES // max(mean, 1.0), MIN_WINDOW), MAX_WINDOW))  # ORDER-NOT-IO


def check_shuffle_option(shuffle: Any, window: int | None) -> None:
    if isinstance(shuffle, str) and shuffle not in MODES:
        raise SpecError(f"shuffle must be True, False, 'block' or 'buffer', got {shuffle!r}")
    if window is not None and window < 1:
        raise SpecError(f"shuffle_window must be >= 1 samples or None, got {window}")


def mode_tag(window: int | None) -> str | None:
    return None if window is None else f"block:{window}"


def with_mode(state: dict, window: int | None) -> dict:
    """``state`` tagged with a block-shuffled pass's shuffle (``"shuffle": "block:<window>"``)."""
    tag = mode_tag(window)
    return state if tag is None else {**state, "shuffle": tag}


def check_mode(state: Any, window: int | None) -> None:
    """A state saved under another shuffle (or another window) cannot restore this pass's order."""
    saved = state.get("shuffle") if isinstance(state, dict) else None
    if saved != mode_tag(window):
        def say(tag: str | None) -> str:
            return "a shuffle buffer or none" if tag is None else f"the block shuffle, window {tag[6:]}"
        raise SpecError(f"this state was saved from a pass shuffled with {say(saved)}, this dataset "
                        f"shuffles with {say(mode_tag(window))}: resume with the same shuffle= and "
                        "shuffle_window= (the default window follows the shards' mean sample size, "
                        "never the fetch settings); a state saved with a shuffle buffer loads into "
                        "shuffle='buffer'")


# ---- the windows and their orders ------------------------------------------------------------


def window_spans(sizes: Sequence[int], window: int, split: bool) -> list[tuple[int, int]]:
    """The windows ``[a, b)`` of a span made of segments of ``sizes`` samples: fixed cuts of
    ``window`` (``split``), else runs of whole segments of at most ``window`` (or one segment)."""
    n = int(sum(sizes))
    if split:
        return [(a, min(a + window, n)) for a in range(0, n, window)]
    out: list[tuple[int, int]] = []
    a = b = 0
    for size in sizes:
        if b > a and b - a + size > window:
            out.append((a, b))
            a = b
        b += int(size)
    if b > a:
        out.append((a, b))
    return out


def _order(material: Sequence[int], n: int) -> np.ndarray:
    return np.random.default_rng([*material, TAG]).permutation(n)


def _within(material: Sequence[int], key: int, n: int) -> np.ndarray:
    return np.random.default_rng([*material, TAG, key + 1]).permutation(n)


def windows_of(sizes: Sequence[int], window: int, split: bool, material: Sequence[int],
               pieces: int = PIECES) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """A span's pieces ``[a, b)`` (``window_spans`` of ``window / pieces`` samples) and its
    windows: the pieces in their seeded order, taken in turn while a window holds at most
    ``window`` samples (always one piece)."""
    spans = window_spans(sizes, -(-window // max(min(pieces, window), 1)), split)
    groups: list[list[int]] = []
    held = window + 1
    for k in _order(material, len(spans)):
        size = spans[k][1] - spans[k][0]
        if held + size > window:
            groups.append([])
            held = 0
        groups[-1].append(int(k))
        held += size
    return spans, groups


def _locate(spans: list[tuple[int, int]], groups: list[list[int]], d: int) -> tuple[int, int]:
    """``(j, r)``: ``d`` put out = windows ``[0, j)`` whole and the first ``r`` of window ``j``."""
    done = 0
    for j, group in enumerate(groups):
        size = sum(spans[k][1] - spans[k][0] for k in group)
        if done + size > d:
            return j, d - done
        done += size
    return len(groups), 0


def delivered_mask(sizes: Sequence[int], d: int, window: int, split: bool, material: Sequence[int],
                   pieces: int = PIECES) -> np.ndarray:
    """Which of a span's samples (segments of ``sizes``) are among its first ``d`` put out."""
    spans, groups = windows_of(sizes, window, split, material, pieces)
    j, r = _locate(spans, groups, d)
    mask = np.zeros(int(sum(sizes)), dtype=bool)
    for group in groups[:j]:
        for k in group:
            mask[spans[k][0]:spans[k][1]] = True
    if j < len(groups) and r:
        held = np.concatenate([np.arange(*spans[k]) for k in groups[j]])  # as read: piece by piece
        mask[held[_within(material, j, len(held))[:r]]] = True
    return mask


def block_runs(window: int, split: bool, seed: int, epoch: int, pieces: int = PIECES):
    """``resume``'s ``undelivered(world, sizes, d)`` for the block shuffle: the runs ``[a, b)`` of
    an old reader's span that its first ``d`` samples put out left out."""
    def runs(world: World, sizes: Sequence[int], d: int) -> list[tuple[int, int]]:
        mask = delivered_mask(sizes, d, window, split, reader_seed(world, seed=seed, epoch=epoch), pieces)
        edges = np.flatnonzero(np.diff(np.concatenate(([1], mask.astype(np.int8), [1]))))
        return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
    return runs


def _cut(segments: Sequence[Segment], a: int, b: int) -> list[Segment]:
    """Samples ``[a, b)`` of the span made of ``segments``, as segments."""
    out: list[Segment] = []
    at = 0
    for s in segments:
        lo, hi = max(a - at, 0), min(b - at, len(s))
        if hi > lo:
            out.append(Segment(s.unit, s.start + lo, s.start + hi))
        at += len(s)
        if at >= b:
            break
    return out


def block_reads(full: Span, d: int, window: int, split: bool, material: Sequence[int],
                tables: bool, pieces: int = PIECES) -> tuple[list[Segment], Windows]:
    """What a reader whose whole span is ``full`` reads, having put out ``d`` of it, and how it
    puts them out: the windows from the one ``d`` falls in, piece after piece, then what is left
    of the plan's ``pad``."""
    own = full.samples - full.pad
    sizes = [len(s) for s in _cut(full.segments, 0, own)]
    spans, groups = windows_of(sizes, window, split, material, pieces)
    j, r = _locate(spans, groups, min(d, own))
    reads: list[Segment] = []
    for group in groups[j:]:
        for k in group:
            reads += _cut(full.segments, *spans[k])
    reads += _cut(full.segments, max(own, d), full.samples)
    plan = Windows(tuple(int(x) for x in material),
                   tuple(sum(spans[k][1] - spans[k][0] for k in g) for g in groups[j:]),
                   tuple(range(j, len(groups))), r, tables)
    return reads, plan


def resumed_reads(span: Span, span_of: Callable[[list[Stage]], Span], stages: Sequence[Stage], world: World,
                  window: int, split: bool, *, seed: int, epoch: int, tables: bool,
                  pieces: int = PIECES) -> tuple[list[Segment], Windows]:
    """:func:`block_reads` for a reader of ``world`` whose span (after ``stages``) is ``span``: on
    the world the last stage ran on, its whole span (``span_of`` with its own count undone) and
    what it had put out, so that it goes on from the window its position is in; else ``span``
    from its start."""
    d, full = 0, span
    if stages and stages[-1].same_shape(world):
        last = stages[-1]
        d = last.delivered[world.slot] or 0
        full = span_of([*stages[:-1], Stage(last.world_size, last.num_workers, [
            0 if i == world.slot else x for i, x in enumerate(last.delivered)])])
    return block_reads(full, d, window, split, reader_seed(world, seed=seed, epoch=epoch), tables, pieces)


# ---- putting a window out --------------------------------------------------------------------


def block_shuffled(items: Iterable[Any], plan: Windows) -> Iterator[Any]:
    """``items`` (read window after window, as ``plan`` says) put out in each window's seeded
    permutation, the first ``plan.skip`` dropped. Samples: about one window held, the next read
    while one is put out (READ-SPREAD, ``_spread``); a window of Arrow tables (``plan.tables``)
    is put out as one table taken in that permutation. A window that comes short (a record
    skipped under ``on_error``) is permuted as it is."""
    it = iter(items)
    if not plan.tables:
        yield from _spread(it, plan)
        return
    skip = plan.skip
    rest: list[Any] = []  # the rows past a window's end, first in the next one
    for size, key in zip(plan.sizes, plan.keys, strict=True):
        window = _take_rows(itertools.chain(rest, it), size, rest)
        if window is None:
            return
        window = window.take(_within(plan.material, key, window.num_rows))
        if skip:
            window, skip = window.slice(skip), 0
        if window.num_rows:
            yield window
    yield from rest
    yield from it  # the plan's pad, as it comes


def _spread(it: Iterator[Any], plan: Windows) -> Iterator[Any]:
    """Samples, window after window, each permuted; the next window is read while this one is
    put out, an even share before each sample (READ-SPREAD), and each sample is let go once put
    out: the reader's work comes evenly, not in one burst of a whole window at each window's
    start (benchmarks/README.md, "Block shuffle windows in a training loop"), and it holds
    about one window."""
    sizes = plan.sizes
    held = list(itertools.islice(it, sizes[0])) if sizes else []  # the first: nothing to put out yet
    skip = plan.skip
    for j, key in enumerate(plan.keys):
        order = _within(plan.material, key, len(held))[skip:]
        coming = sizes[j + 1] if j + 1 < len(sizes) else 0
        after: list[Any] = []
        for i, k in enumerate(order):
            due = -(-(i + 1) * coming // len(order))  # read so far: this share of the next window
            if len(after) < due:
                after += itertools.islice(it, due - len(after))
            sample, held[k] = held[k], None
            yield sample
        if len(after) < coming:  # this window put out nothing (all delivered before a resume)
            after += itertools.islice(it, coming - len(after))
        held, skip = after, 0
    yield from it  # the plan's pad, as it comes


def _take_rows(tables: Iterator[Any], rows: int, rest: list[Any]) -> Any:
    """The next ``rows`` rows of ``tables`` as one table (fewer at their end; None if none); the
    rows of a table past them go to ``rest`` (emptied first)."""
    import pyarrow as pa  # only the Arrow formats' records are tables

    held, n = [], 0
    for table in tables:
        held.append(table)
        n += table.num_rows
        if n >= rows:
            break
    rest.clear()
    if not held:
        return None
    window = pa.concat_tables(held) if len(held) > 1 else held[0]
    if n > rows:  # not with exact counts (a record skipped under on_error shifts the windows)
        rest.append(window.slice(rows))
        window = window.slice(0, rows)
    return window
