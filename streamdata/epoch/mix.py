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
of the rank: readers of the same worker index make the same choices on every rank. With every
source's sample counts known, each reader's quotas (the samples it takes of each source in the
stage) are the same on every rank too (:func:`quotas`), so every rank yields the same number
of samples.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from streamdata.epoch.plan import slot_sizes
from streamdata.epoch.resume import Stage, UnitPosition, resume_span
from streamdata.epoch.world import World

__all__ = ["BLOCK", "CYCLE_STRIDE", "FULL", "choices", "counts_before", "entry_of", "mix_fingerprint",
           "parse_entry", "quotas", "source_stages", "split_budget", "start_entry", "taken_in_stage"]

BLOCK = 1024  # choices per seeded block: position t is reached without drawing what is before it
CYCLE_STRIDE = 1 << 32  # a source's epoch in cycle c of mix epoch e: e + c * CYCLE_STRIDE
FULL = 1 << 53  # a source position past any span: "delivered all of it" (clamped by ``resume``)
_MAGIC = 0x6D6978  # "mix": keeps these draws apart from the plan's own seeds


def choices(probs: np.ndarray, seed: int, epoch: int, stage: int, worker: int,
            start: int = 0) -> Iterator[int]:
    """The sources chosen at positions ``start, start + 1, ...`` (MIX-CHOICES)."""
    block, i = divmod(start, BLOCK)
    while True:
        rng = np.random.default_rng([seed, epoch, stage, worker, block, _MAGIC])
        yield from rng.choice(len(probs), BLOCK, p=probs)[i:].tolist()
        block, i = block + 1, 0


def counts_before(probs: np.ndarray, seed: int, epoch: int, stage: int, worker: int, t: int) -> list[int]:
    """How many times each source was chosen at positions ``[0, t)``."""
    out = np.zeros(len(probs), dtype=np.int64)
    for block in range(-(-t // BLOCK)):
        rng = np.random.default_rng([seed, epoch, stage, worker, block, _MAGIC])
        draws = rng.choice(len(probs), BLOCK, p=probs)[: t - block * BLOCK]
        out += np.bincount(draws, minlength=len(probs))
    return out.tolist()


def taken_in_stage(probs: np.ndarray, seed: int, epoch: int, stage: int, worker: int, quotas: Sequence[int],
                   stop: str) -> int:
    """The samples a reader takes in a stage whose quotas are ``quotas``: ``stop="first"``, up to
    the first choice of a source that has delivered its quota; ``"all"``, until every source has
    (the choices drawn as the pass draws them, a block at a time: no sample read)."""
    need = np.asarray(quotas, dtype=np.int64)
    if stop == "all" and not need.any():
        return 0
    counts = np.zeros(len(probs), dtype=np.int64)
    block = 0
    while True:
        rng = np.random.default_rng([seed, epoch, stage, worker, block, _MAGIC])
        draws = rng.choice(len(probs), BLOCK, p=probs)
        seen = np.zeros((BLOCK, len(probs)), dtype=np.int64)  # choices of each source before each draw
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

