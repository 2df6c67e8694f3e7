"""Saved positions in an epoch: the state a dataset's ``state_dict()`` returns and ``load_state_dict`` takes.

A state is plain JSON-serialisable data, small (one integer per reader, two for a shard-level
split), versioned, and tied to its dataset by a fingerprint (shard URLs, sizes and sample
counts, seed, shuffle, batch size, drop_last), so loading it into another dataset is refused::

    {"format": "streamdata-state", "version": 1, "fingerprint": "3f0c...", "epoch": 2,
     "split": "samples",                       # or "units" (shard-level: counts unknown)
     "stages": [{"world": [2, 2], "delivered": [40, 38, null, 40]}]}

``stages`` says where the epoch stands (``resume``): the world shapes it ran on, and for each
reader (slot ``rank * num_workers + worker``) how many samples it had delivered (``"units"``:
``[units done, samples into the next]``); ``null`` where this process does not know (another
DataLoader worker's, another rank's: :func:`merge_states` fills them in). No stage: the epoch's
start. The position counts what the reader *yielded*, so it is exact where it is taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

from streamdata.epoch.resume import Stage, UnitPosition
from streamdata.epoch.rewind import Rewind, record_size
from streamdata.epoch.world import World
from streamdata.errors import SpecError

__all__ = ["STATE_FORMAT", "STATE_VERSION", "Loaded", "Position", "check_batching", "check_header",
           "dataset_key", "fingerprint", "merge_states", "parse_state", "reader_state", "stages_json",
           "start_state"]

log = logging.getLogger("streamdata")

STATE_FORMAT = "streamdata-state"
STATE_VERSION = 1


def fingerprint(shards: Iterable[Any], counts: Sequence[int] | None, *, seed: int, shuffle: bool) -> str:
    """A short digest of what fixes an epoch's plan (the batching is checked apart, as a pass
    starts: ``check_batching``): a state made for another dataset is refused."""
    data = {"shards": [[s.url, s.size] for s in shards], "counts": None if counts is None else
            [int(c) for c in counts], "seed": seed, "shuffle": bool(shuffle)}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


def dataset_key(dataset: Any) -> tuple[str, str]:
    """A sharded dataset's fingerprint and split (``"samples"`` with sample counts, else
    ``"units"``), from its ``shards``, ``sample_counts()``, ``seed`` and ``shuffle``."""
    counts = dataset.sample_counts()
    fp = fingerprint(dataset.shards, counts, seed=dataset.seed, shuffle=dataset.shuffle)
    return fp, "units" if counts is None else "samples"


def stages_json(stages: Sequence[Stage]) -> list[dict]:
    """Stages as the state holds them: a ``UnitPosition`` as ``[done, into]``."""
    return [{"world": [s.world_size, s.num_workers],
             "delivered": [list(d) if isinstance(d, UnitPosition) else d for d in s.delivered]}
            for s in stages]


def check_header(state: Any) -> None:
    """Raise SpecError unless ``state`` is a dict of this format and version (a dataset's state
    or a Mix's: what each holds is checked by its ``load_state_dict``)."""
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise SpecError(f"not a streamdata state (no 'format': {STATE_FORMAT!r}): {str(state)[:120]}")
    if state.get("version") != STATE_VERSION:
        raise SpecError(f"a streamdata state of version {state.get('version')!r}; this streamdata reads "
                        f"version {STATE_VERSION}: upgrade streamdata, or start the epoch again")


def parse_state(state: Any, expected: str, split: str, buffer: int = 0) -> tuple[int, list[Stage]]:
    """``(epoch, stages)`` of a state made by a dataset whose fingerprint is ``expected`` (with a
    shuffle ``buffer`` and no sample counts, a resume is exact only within a buffer: a warning)."""
    check_header(state)
    if state.get("fingerprint") != expected:
        raise SpecError("this state belongs to another dataset (its shards, sizes, sample counts, seed, "
                        "shuffle, batch size or drop_last differ): load it into the dataset it was saved "
                        f"from (state {state.get('fingerprint')!r}, this dataset {expected!r})")
    if state.get("split") != split:
        raise SpecError(f"this state was saved from a {state.get('split')}-level split, this dataset "
                        f"splits by {split} (an index added or removed?): start the epoch again")
    try:
        stages = [Stage(int(s["world"][0]), int(s["world"][1]), [_entry(d, split) for d in s["delivered"]])
                  for s in state["stages"]]
        if split == "units" and buffer > 1 and stages:
            log.warning("resuming a shard-level split (no sample index) behind a shuffle buffer of %d: "
                        "up to about one buffer per reader may be delivered twice or not at all; for "
                        "an exact resume build the index (streamdata index SPEC) or use shuffle_buffer=0",
                        buffer)
        return int(state["epoch"]), stages
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecError(f"a malformed streamdata state: {type(exc).__name__}: {exc}") from exc


def _entry(d: Any, split: str) -> int | UnitPosition | None:
    """A saved reader's position: samples delivered, or (``"units"``) ``[done, into]``."""
    if d is None:
        return None
    if split == "units":
        done, into = d
        return UnitPosition(int(done), int(into))
    return int(d)


def merge_states(states: Sequence[dict]) -> dict:
    """One state from several readers' states of the same epoch (each knowing its own positions):
    every known position filled in. Raises SpecError when they disagree."""
    states = [s for s in states if s]
    if not states:
        raise SpecError("no state to merge")
    out = json.loads(json.dumps(states[0]))
    for other in states[1:]:
        keys = ("format", "version", "fingerprint", "split", "epoch", "shuffle")
        if any(other.get(k) != out.get(k) for k in keys):
            raise SpecError("states of different datasets or epochs cannot be merged: "
                            + ", ".join(f"{k}={out.get(k)!r}/{other.get(k)!r}" for k in keys
                                        if other.get(k) != out.get(k)))
        if len(other["stages"]) != len(out["stages"]):
            raise SpecError("states with different resume histories cannot be merged")
        out_stages = out["stages"]
        for mine, theirs in zip(out_stages, other["stages"], strict=True):
            if mine["world"] != theirs["world"]:
                raise SpecError(f"states from different worlds: {mine['world']} and {theirs['world']}")
            for slot, d in enumerate(theirs["delivered"]):
                if d is not None and mine["delivered"][slot] is None:
                    mine["delivered"][slot] = d
    return out


class Loaded(NamedTuple):
    """A state ``load_state_dict`` took, kept until its epoch's pass begins: the epoch, its
    stages, and the batching it was saved with (``[batch_size, drop_last]``; None for a Mix's)."""

    epoch: int
    stages: list[Stage]
    batching: list | None = None


class Position:
    """Where one reader stands in its pass: what it delivered, on top of where its pass began.

    ``before``: the stages that led to this pass; the pass is a stage of shape ``world`` in
    which this reader had delivered ``base`` when the pass began (its own position, resumed):
    samples (an int), or, for a shard-level split (``split == "units"``), a ``UnitPosition``;
    there ``unit_counts`` are the samples read from each unit so far."""

    def __init__(self, world: World, epoch: int, split: str, before: Sequence[Stage] = (),
                 base: int | Sequence[int] | None = None) -> None:
        self.world, self.epoch, self.split = world, epoch, split
        self.before = list(before)
        self.base: int | UnitPosition
        if base is None:
            self.base = UnitPosition(0, 0) if split == "units" else 0
        elif isinstance(base, int):
            self.base = base
        else:
            self.base = UnitPosition(int(base[0]), int(base[1]))
        self.delivered = 0
        self.unit_counts: list[int] = []
        self.finished = 0  # units read to their end
        self.rewind: Rewind | None = None  # RESUME-BUFFER (``rewind``)

    batching: list = [None, False]

    @classmethod
    def of_pass(cls, world: World, epoch: int, split: str, stages: Sequence[Stage],
                batching: list) -> Position:
        """A pass's position: on top of its own saved one when it continues (RESUME-CONTINUES)."""
        if stages and stages[-1].same_shape(world):
            pos = cls(world, epoch, split, stages[:-1], stages[-1].delivered[world.slot])
        else:
            pos = cls(world, epoch, split, stages)
        pos.batching = batching
        return pos

    @property
    def samples_before(self) -> int:
        """Samples this reader had delivered when the pass began (a split by samples; else 0)."""
        return self.base if isinstance(self.base, int) else 0

    def count(self, items: Iterable[Any], size: Callable[[Any], int] | None = None) -> Iterator[Any]:
        """``items`` unchanged, each counted as delivered as it is taken (``size(item)`` samples)."""
        for item in items:
            self.delivered += 1 if size is None else size(item)
            yield item

    def count_unit(self, records: Iterable[Any], size: Callable[[Any], int] | None = record_size
                   ) -> Iterator[Any]:
        """One unit's records (shard-level split), counted as read; each is passed on once the
        next is read (or the unit has ended), so a unit whose last record is delivered is known
        to be done, and a resume does not ask for it again."""
        self.unit_counts.append(0)
        i = len(self.unit_counts) - 1
        it = iter(records)
        try:
            ahead = [next(it)]
            while ahead:
                record = ahead.pop()
                try:
                    ahead.append(next(it))
                except StopIteration:
                    self.finished = i + 1
                except BaseException:
                    self.unit_counts[i] += 1 if size is None else size(record)
                    yield record
                    raise
                self.unit_counts[i] += 1 if size is None else size(record)
                yield record
        except StopIteration:  # an empty unit
            self.finished = i + 1
        finally:
            getattr(it, "close", lambda: None)()

    def mine(self) -> int | UnitPosition:
        """This reader's position in the pass's stage."""
        if not isinstance(self.base, UnitPosition):
            return self.base + self.delivered
        done, into = self.base
        left = self.delivered
        for i, n in enumerate(self.unit_counts):
            if i < self.finished and left >= n:  # every sample of a unit read whole delivered
                left -= n
                done, into = done + 1, 0
                continue
            break
        return UnitPosition(done, into + left)

    def state(self, fp: str) -> dict:
        return {**start_state(fp, self.epoch, self.split),
                "stages": stages_json([*self.before, Stage.own(self.world, self.mine())])}


def start_state(fp: str, epoch: int, split: str) -> dict:
    """The state of an epoch's start."""
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": fp, "epoch": epoch,
            "split": split, "stages": []}


def reader_state(fp: str, split: str, live: Position | None, resume: Loaded | None, epoch: int,
                 batching: list) -> dict:
    """A dataset's ``state_dict()``: its current pass's position, else the one loaded, else the
    epoch's start."""
    if live is not None:
        return {**live.state(fp), "batching": live.batching}
    if resume is not None and resume.epoch == epoch:  # (another epoch's is never read)
        return {**start_state(fp, epoch, split), "stages": stages_json(resume.stages),
                "batching": resume.batching}
    return {**start_state(fp, epoch, split), "batching": batching}


def check_batching(saved: list, batch_size: int | None, drop_last: bool) -> None:
    """A resumed pass must leave out what the saved one did: with ``drop_last``, the same batch
    size (the plan's spans depend on it); without, only the batch sizes may change (sd.loader
    batches in the workers, or in the DataLoader with ``num_workers=0``)."""
    now = bool(drop_last and batch_size is not None)
    if bool(saved[1]) != now or (now and saved[0] != batch_size):
        raise SpecError(f"this state was saved from a pass batched as (batch_size, drop_last) = "
                        f"{tuple(saved)}, this pass is ({batch_size}, {drop_last}): resume with the "
                        "same batching")
