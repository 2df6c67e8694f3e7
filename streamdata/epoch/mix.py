"""A mix's pure half (:class:`~streamdata.datasets.mix.Mix`): its choice sequence, state and quotas.

No I/O. A mix's state is the dataset state of :mod:`streamdata.epoch.state` (same format, version,
fingerprint, epoch and ``stages`` of world shapes) with ``"split": "mix"``; each reader's entry
in a stage is ``{"t": choices taken, "sources": [[cycle, position], ...]}`` (a source's
``position`` is its own entry in that stage: an integer, or ``[units done, samples into the
next]``), ``0`` for a reader that has taken nothing yet, ``null`` for one this process does not
know. So ``state.merge_states`` and ``sd.loader``'s gathering (``checkpoint``) work unchanged,
and a source's own state is rebuilt from the mix's (:func:`source_stages`).

Invariant (MIX-CHOICES): the choices of a reader are a function of ``(seed, epoch, stage,
worker)`` and the position ``t`` alone (blocks of ``BLOCK`` draws, each seeded on its own), never
of the rank: readers of the same worker index make the same choices on every rank. A
:class:`Schedule`'s weights at ``t`` follow the progress of the whole job (:class:`Scheduled`):
the samples taken in the epoch's earlier stages plus ``t`` times the stage's readers, a number
every reader of the stage computes alike from the state, on any world. With every
source's sample counts known, each reader's quotas (the samples it takes of each source in the
stage) are the same on every rank too (:func:`quotas`), so every rank yields the same number
of samples.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from streamdata.epoch.plan import slot_sizes
from streamdata.epoch.resume import Stage, UnitPosition, resume_span
from streamdata.epoch.world import World
from streamdata.errors import SpecError

__all__ = ["BLOCK", "CYCLE_STRIDE", "FULL", "Probs", "Schedule", "Scheduled", "choices", "counts_before",
           "entry_of", "mix_fingerprint", "parse_entry", "quotas", "source_stages", "split_budget",
           "start_entry", "taken_in_stage"]

BLOCK = 1024  # choices per seeded block: position t is reached without drawing what is before it
CYCLE_STRIDE = 1 << 32  # a source's epoch in cycle c of mix epoch e: e + c * CYCLE_STRIDE
FULL = 1 << 53  # a source position past any span: "delivered all of it" (clamped by ``resume``)
_MAGIC = 0x6D6978  # "mix": keeps these draws apart from the plan's own seeds


class Schedule:
    """Mixture weights that change over an epoch (``sd.Mix(sources, weights=sd.Schedule(...))``).

    ``points``: ``[(x, weights), ...]`` with ``x`` increasing, the weights interpolated linearly
    between points and held before the first and after the last; or a callable
    ``f(x) -> weights`` (picklable, for DataLoader workers: a module-level function or a
    ``functools.partial`` of one; pure: the same ``x`` gives the same weights). Weights are
    numbers >= 0 with a positive sum, one per source. ``by``: what ``x`` counts, for the whole job
    (every rank and worker together) from the epoch's start: ``"fraction"`` of the epoch's length
    (``samples=N``: of ``N``; with ``stop=``, of every source's samples together; from 0 to 1,
    held at 1 after) or ``"samples"`` taken.
    """

    BY = ("fraction", "samples")

    def __init__(self, points: Sequence[tuple[float, Sequence[float]]] | Callable[[float], Sequence[float]],
                 by: str = "fraction") -> None:
        if by not in self.BY:
            raise SpecError(f"a Schedule's by must be 'fraction' or 'samples', got {by!r}")
        self.by = by
        self.fn: Callable[[float], Sequence[float]] | None = None
        self.xs: np.ndarray | None = None
        self.ws: np.ndarray | None = None
        if callable(points):
            try:
                pickle.dumps(points)
            except Exception as exc:
                raise SpecError(f"the Schedule's function {points!r} cannot be pickled "
                                f"({type(exc).__name__}), so DataLoader workers cannot receive it: define "
                                "it at a module's top level (not a lambda or a nested function), or give "
                                "points [(x, weights), ...]") from exc
            self.fn = points
            return
        try:
            pairs = [(float(x), [float(w) for w in ws]) for x, ws in points]
        except (TypeError, ValueError) as exc:
            raise SpecError(f"a Schedule takes [(x, [weight, ...]), ...] or a function, got {points!r}") \
                from exc
        if not pairs:
            raise SpecError("a Schedule needs at least one point (x, weights)")
        xs = [x for x, _ in pairs]
        if not all(math.isfinite(x) and x >= 0 for x in xs) or any(np.diff(xs) <= 0):
            raise SpecError(f"a Schedule's x must be finite, >= 0 and increasing, got {xs}")
        if len({len(ws) for _, ws in pairs}) > 1:
            raise SpecError(f"a Schedule's points give different numbers of weights: {[w for _, w in pairs]}")
        for x, ws in pairs:
            _check_weights(ws, x)
        self.xs, self.ws = np.asarray(xs), np.asarray([ws for _, ws in pairs])

    def __call__(self, x: float) -> list[float]:
        """The weights at ``x`` (not normalised)."""
        return self.at(np.asarray([x], dtype=np.float64))[0].tolist()

    def at(self, x: np.ndarray) -> np.ndarray:
        """The weights at each ``x``: an array (len(x), sources)."""
        if self.fn is not None:
            rows = []
            for v in x.tolist():
                ws = self.fn(v)
                try:
                    ws = [float(w) for w in ws]
                except (TypeError, ValueError) as exc:
                    raise SpecError(f"the Schedule's function gave {ws!r} at {v}: give a list of numbers") \
                        from exc
                rows.append(_check_weights(ws, v))
            if len({len(r) for r in rows}) > 1:
                raise SpecError("the Schedule's function gave different numbers of weights")
            return np.asarray(rows, dtype=np.float64).reshape(len(rows), -1)
        assert self.xs is not None and self.ws is not None
        return np.stack([np.interp(x, self.xs, self.ws[:, k]) for k in range(self.ws.shape[1])], axis=1)

    def final(self) -> list[float] | None:
        """The weights that hold at the end: after the last point, or a function's at 1 (``by=
        "fraction"``); None for a function of ``"samples"`` (no end)."""
        if self.ws is not None:
            return self.ws[-1].tolist()
        return self(1.0) if self.by == "fraction" else None

    def describe(self) -> dict:
        """What a saved state must match: the points, or the function's module and name."""
        if self.fn is not None:
            fn = getattr(self.fn, "func", self.fn)  # (a functools.partial: its function)
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
            return {"by": self.by, "function": name}
        assert self.xs is not None and self.ws is not None
        points = zip(self.xs.tolist(), self.ws.tolist(), strict=True)
        return {"by": self.by, "points": [[x, w] for x, w in points]}

    def __repr__(self) -> str:
        what = self.fn if self.fn is not None else self.describe()["points"]
        return f"Schedule({what!r}, by={self.by!r})"


def _check_weights(ws: list[float], x: float) -> list[float]:
    if not ws or not all(math.isfinite(w) and w >= 0 for w in ws) or sum(ws) <= 0:
        raise SpecError(f"a Schedule's weights at {x} must be numbers >= 0 with a positive sum, got {ws}")
    return ws


class Scheduled(NamedTuple):
    """A schedule over one stage's positions: the choice at position ``t`` of any of its readers
    uses the weights at ``(start + t * readers) / horizon`` (``by="fraction"``, at most 1) or at
    ``start + t * readers`` (``"samples"``): ``start``, the samples the epoch's earlier stages
    took over the job; ``readers``, the stage's (ranks x workers), each at about its own ``t``."""

    schedule: Schedule
    start: int
    readers: int
    horizon: int | None  # by="fraction": the epoch's length

    def __call__(self, t: np.ndarray) -> np.ndarray:
        """The probabilities at positions ``t``: an array (len(t), sources)."""
        x = (self.start + t.astype(np.float64) * self.readers)
        if self.schedule.by == "fraction":
            x = np.minimum(x / max(self.horizon or 0, 1), 1.0)
        ws = self.schedule.at(x)
        return ws / ws.sum(axis=1, keepdims=True)


Probs = np.ndarray | Scheduled  # constant probabilities, or a schedule's


def _draws(probs: Probs, seed: int, epoch: int, stage: int, worker: int, block: int) -> np.ndarray:
    """The ``BLOCK`` choices of block ``block`` (constant probabilities: ``Generator.choice``'s
    own draws; a schedule: the same inverse-CDF draw, row by row)."""
    rng = np.random.default_rng([seed, epoch, stage, worker, block, _MAGIC])
    if isinstance(probs, np.ndarray):
        return rng.choice(len(probs), BLOCK, p=probs)
    cdf = np.cumsum(probs(np.arange(block * BLOCK, (block + 1) * BLOCK)), axis=1)
    cdf /= cdf[:, -1:]
    return (cdf <= rng.random(BLOCK)[:, None]).sum(axis=1)


def choices(probs: Probs, seed: int, epoch: int, stage: int, worker: int, start: int = 0) -> Iterator[int]:
    """The sources chosen at positions ``start, start + 1, ...`` (MIX-CHOICES)."""
    block, i = divmod(start, BLOCK)
    while True:
        yield from _draws(probs, seed, epoch, stage, worker, block)[i:].tolist()
        block, i = block + 1, 0


def counts_before(probs: Probs, seed: int, epoch: int, stage: int, worker: int, t: int) -> list[int]:
    """How many times each source was chosen at positions ``[0, t)``."""
    n = _width(probs)
    out = np.zeros(n, dtype=np.int64)
    for block in range(-(-t // BLOCK)):
        draws = _draws(probs, seed, epoch, stage, worker, block)[: t - block * BLOCK]
        out += np.bincount(draws, minlength=n)
    return out.tolist()


def taken_in_stage(probs: Probs, seed: int, epoch: int, stage: int, worker: int, quotas: Sequence[int],
                   stop: str) -> int:
    """The samples a reader takes in a stage whose quotas are ``quotas``: ``stop="first"``, up to
    the first choice of a source that has delivered its quota; ``"all"``, until every source has
    (the choices drawn as the pass draws them, a block at a time: no sample read)."""
    need = np.asarray(quotas, dtype=np.int64)
    if stop == "all" and not need.any():
        return 0
    n = len(need)
    counts = np.zeros(n, dtype=np.int64)
    block = 0
    while True:
        draws = _draws(probs, seed, epoch, stage, worker, block)
        seen = np.zeros((BLOCK, n), dtype=np.int64)  # choices of each source before each draw
        seen[np.arange(BLOCK), draws] = 1
        before = counts + np.cumsum(seen, axis=0) - seen
        if stop == "first":
            over = np.flatnonzero(before[np.arange(BLOCK), draws] >= need[draws])
        else:
            over = np.flatnonzero((before >= need).all(axis=1))
        if len(over):
            return block * BLOCK + int(over[0])
        counts += seen.sum(axis=0)
        block += 1


def _width(probs: Probs) -> int:
    return len(probs) if isinstance(probs, np.ndarray) else int(probs(np.zeros(1, dtype=np.int64)).shape[1])


def mix_fingerprint(describe: dict) -> str:
    return hashlib.sha256(json.dumps(describe, sort_keys=True).encode()).hexdigest()[:24]


def parse_entry(entry: Any, splits: Sequence[str]) -> dict | None:
    """A reader's entry, checked: ``None``, or ``{"t", "sources": [[cycle, position]...]}``
    (``0``: the stage's start)."""
    if entry is None:
        return None
    if entry == 0:
        return start_entry(splits)
    sources = entry["sources"]
    if len(sources) != len(splits):
        raise ValueError(f"an entry of {len(sources)} sources for a mix of {len(splits)}")
    out = []
    for (cycle, position), split in zip(sources, splits, strict=True):
        position = [int(position[0]), int(position[1])] if split == "units" else int(position)
        out.append([int(cycle), position])
    return {"t": int(entry["t"]), "sources": out, **({"end": True} if entry.get("end") else {})}


def start_entry(splits: Sequence[str]) -> dict:
    """The entry of a reader that has taken nothing in its stage (saved as ``0``)."""
    return {"t": 0, "sources": [[0, [0, 0] if s == "units" else 0] for s in splits]}


def entry_of(t: int, cycles: Sequence[int], positions: Sequence[Any], end: bool = False) -> dict:
    """A reader's entry; ``"end": true`` once its pass has ended (nothing more to take)."""
    entry = {"t": int(t), "sources": [[int(c), p] for c, p in zip(cycles, positions, strict=True)]}
    return {**entry, "end": True} if end else entry


def source_stages(stages: Sequence[Stage[dict]], k: int, split: str) -> list[Stage[Any]]:
    """Source ``k``'s stages of its primary epoch, from the mix's: a reader that had cycled
    ``k`` had delivered all of its span, and one that had ended will deliver no more of it
    (what it left was counted as undelivered): ``FULL``."""
    def position(entry: dict | None) -> int | UnitPosition | None:
        if entry is None:
            return None
        cycle, saved = entry["sources"][k]
        done = bool(cycle or entry.get("end"))
        if split == "units":
            return UnitPosition(FULL, 0) if done else UnitPosition(int(saved[0]), int(saved[1]))
        return FULL if done else int(saved)

    return [Stage(stage.world_size, stage.num_workers, [position(e) for e in stage.delivered])
            for stage in stages]


def quotas(counts: np.ndarray, before: Sequence[Stage[int]], shape: tuple[int, int], worker: int, *,
           seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The samples of one source's primary epoch that the reader of ``worker`` on each rank
    holds in a stage of ``shape`` (ranks, workers) that began after ``before``."""
    ranks, workers = shape
    if not before:
        sizes = slot_sizes(int(np.sum(counts)), World(0, ranks, 0, workers))
        return [int(sizes[r * workers + worker]) for r in range(ranks)]
    return [resume_span(counts, before, World(r, ranks, worker, workers), seed=seed, epoch=epoch,
                        shuffle=shuffle).samples for r in range(ranks)]


def split_budget(total: int, shape: tuple[int, int], worker: int) -> tuple[int, int]:
    """``samples=N``: this worker index's share of ``total`` on every rank, and what the
    division leaves out (``total % ranks``), so that every rank takes the same number."""
    ranks, workers = shape
    per_rank = max(total, 0) // ranks
    q, extra = divmod(per_rank, workers)
    return q + (1 if worker < extra else 0), max(total, 0) - per_rank * ranks

