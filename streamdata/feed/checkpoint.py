"""``sd.loader``'s saved position: every reader's, gathered, so one rank's state restarts any world.

Each batch leaves its worker tagged with that worker's dataset state, taken right after the
dataset yielded it (:class:`Positioned`, the last step of the worker's ``collate_fn``); the
``Loader`` records the tag as it hands the batch to the training loop (:class:`Positions`;
with the GPU feed, tags are taken off before it and recorded, in order, as its batches come
out), so the recorded position is what the loop received, whatever was prefetched behind it.
``state_dict()`` merges the latest tag of every worker of this rank, fills in the workers that
have delivered nothing yet, and, with ``torch.distributed`` initialised, gathers every rank's:
the result holds every reader's position (``state.merge_states``) and restarts on any world
shape (RESUME-ELASTIC in ``resume``).

CONSUMED-POSITION: the saved position counts the batches the training step consumed. A framework
that takes batches ahead of its step (Lightning's fetcher, Ray's ``prepare_data_loader`` wrapper:
one) holds them when it saves; with ``held_ahead=k`` the last ``k`` batches handed out are left out
of the state until the epoch's iteration has ended (then the framework holds none: it met the end
while taking ahead), so a resume reads them again. Once an epoch's iteration has ended, the state
is the next epoch's start: a checkpoint taken at an epoch's end resumes with the next epoch.
A dataset with ``consumed_counts`` (``sd.Mix``: its epoch's accounting) has its counters follow the
same batches: each tag carries its reader's counters (``metrics.Consumed``), taken in as the tag
is recorded, and what readers counted after their last batches once the iteration has ended.

HELD-AHEAD-DETECTED: without a ``held_ahead`` given, each iteration takes it from whoever asks for
its first batch (:func:`held_ahead_of`, once per iteration, not per batch): Lightning's data
fetchers (one ahead when the loader has no ``len()``, else none), Ray Train's
``prepare_data_loader`` wrapper (one); 0 for anything else (a plain loop, Fabric, accelerate).
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from streamdata._compat import ahead_by_lightning, ahead_by_ray_train
from streamdata.epoch.state import merge_states
from streamdata.epoch.world import World
from streamdata.errors import SpecError

__all__ = ["Positioned", "Positions", "Stripped", "Tagged", "held_ahead_of"]

_FRAMES = 8  # frames above the first next() searched: a fetcher calls it through a few of its own
_AHEAD: tuple[tuple[str, Callable[[Any], int | None]], ...] = (
    ("Lightning's data fetcher", ahead_by_lightning),
    ("Ray Train's prepare_data_loader wrapper", ahead_by_ray_train),
)


class Tagged(NamedTuple):
    """A batch on its way from a worker, with the state of the worker's dataset after it."""

    batch: Any
    worker: int
    state: dict | None
    counts: tuple[int, list[int]] | None = None  # the reader's row of counters that follow the loop


class Positioned:
    """A picklable ``collate_fn``: the caller's, its batch tagged with the reader's state."""

    def __init__(self, collate_fn: Any, dataset: Any) -> None:
        self.collate_fn, self.dataset = collate_fn, dataset

    def __call__(self, samples: Any) -> Tagged:
        from torch.utils.data import get_worker_info

        batch = self.collate_fn(samples)
        info = get_worker_info()
        dataset: Any = info.dataset if info is not None else self.dataset
        consumed = getattr(dataset, "consumed_counts", None)
        counts = consumed.tag() if consumed is not None else None
        return Tagged(batch, 0 if info is None else info.id, dataset.state_dict(), counts)


class Positions:
    """The latest state each worker's delivered batch carried, on the main process's side
    (CONSUMED-POSITION: less the last ``held_ahead`` batches while the epoch's iteration runs)."""

    def __init__(self, dataset: Any, num_workers: int, held_ahead: int = 0) -> None:
        self.dataset, self.num_workers = dataset, max(num_workers, 1)
        self.held_ahead = held_ahead
        self.latest: dict[int, dict] = {}
        self.consumed = getattr(dataset, "consumed_counts", None)  # counters kept as the state is
        self.delivered = 0  # batches handed out since the loader was made
        self.ended = False  # the last iteration ran to its end: the state is the next epoch's start
        self._held: collections.deque[Tagged | None] = collections.deque()  # handed out, maybe held
        self._pending: collections.deque[Tagged | None] = collections.deque()  # (``strip``)

    def strip(self, batches: Iterator[Any]) -> Iterator[Any]:
        """Upstream of a prefetcher (the GPU feed): the batches without their tags, each tag
        queued to be recorded when its batch comes out of :meth:`deliver` (the feed keeps order)."""
        for item in batches:
            if isinstance(item, Tagged):
                self._pending.append(item)
                item = item.batch
            else:
                self._pending.append(None)
            yield item

    def deliver(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The batches as the loop receives them, without their tags; each tag recorded then."""
        self._pending.clear()
        for item in batches:
            tag = item if isinstance(item, Tagged) else self._pending.popleft() if self._pending else None
            self._record(tag)
            yield item.batch if isinstance(item, Tagged) else item

    def _record(self, tag: Tagged | None) -> None:
        if self.ended:  # the first batch of another pass
            self.ended = False
            self._held.clear()
        self.delivered += 1
        self._held.append(tag if tag is not None and tag.state is not None else None)
        while len(self._held) > self.held_ahead:  # consumed: a framework holds only held_ahead
            self._commit(self._held.popleft())

    def begin(self) -> None:
        """An iteration is about to start the readers (before they read: ``Consumed.begin``)."""
        if self.consumed is not None:
            self.consumed.begin()

    def _commit(self, tag: Tagged | None) -> None:
        if tag is not None and tag.state is not None:
            self.latest[tag.worker] = tag.state
            if self.consumed is not None and tag.counts is not None:
                self.consumed.deliver(*tag.counts)

    def end(self) -> None:
        """The epoch's iteration ran to its end: every batch handed out is consumed."""
        while self._held:
            self._commit(self._held.popleft())
        if self.consumed is not None:  # what the readers counted after their last batches
            self.consumed.end()
        self.ended = True

    def state_dict(self) -> dict:
        """Every reader's position: this rank's workers, and every rank's when torch.distributed
        is initialised (a collective: call it on every rank)."""
        import torch.distributed as dist

        base = self.dataset.state_dict()  # the epoch's start, or the position loaded
        if self.ended:  # CONSUMED-POSITION: after the epoch's end, the next epoch's start
            epoch = max((s.get("epoch", 0) for s in self.latest.values()), default=base.get("epoch", 0))
            state = {**base, "epoch": int(epoch) + 1, "stages": []}
        else:
            mine = [s for s in self.latest.values() if s.get("epoch") == max(
                x.get("epoch", 0) for x in self.latest.values())]
            state = merge_states(mine) if mine else base
            state = _fill(state, base, World.current(getattr(self.dataset, "data_parallel", None)).rank)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, state)
            state = merge_states(every)
        return json.loads(json.dumps(state))

    def load_state_dict(self, state: dict) -> None:
        if self.delivered:
            raise SpecError("load_state_dict() must come before the loader's first iteration delivers a "
                            "batch (its workers read the position when they start)")
        self.dataset.load_state_dict(state)
        self.reset()

    def reset(self) -> None:
        self.latest.clear()
        self._held.clear()
        self.ended = False


class Stripped:
    """An iterable of tagged batches, stripped (:meth:`Positions.strip`): what the GPU feed
    reads, so that its ``transform`` sees the batches themselves."""

    def __init__(self, source: Any, positions: Positions) -> None:
        self.source, self.positions = source, positions

    def __iter__(self) -> Iterator[Any]:
        return self.positions.strip(iter(self.source))

    def __len__(self) -> int:
        return len(self.source)


def held_ahead_of(caller: Any) -> tuple[int, str | None]:
    """HELD-AHEAD-DETECTED: the batches the code iterating a loader takes ahead of its training
    step, and what it is (None: nothing known), from ``caller``, the frame that asked for an
    iteration's first batch, and the frames above it (at most ``_FRAMES``). The frame walk reads
    each frame's module name, and the ``self`` of a frame in a known module only."""
    frame = caller
    for _ in range(_FRAMES):
        if frame is None:
            break
        for name, ahead in _AHEAD:
            n = ahead(frame)
            if n is not None:
                return n, name
        frame = frame.f_back
    return 0, None


def _fill(state: dict, base: dict, rank: int) -> dict:
    """This rank's readers that have delivered nothing yet: at the position they start from."""
    state = json.loads(json.dumps(state))
    if not state.get("stages"):
        return state
    last = state["stages"][-1]
    workers = last["world"][1]
    same = (base.get("epoch") == state.get("epoch") and len(base.get("stages", [])) == len(state["stages"])
            and base["stages"][-1]["world"] == last["world"])
    zero = [0, 0] if state.get("split") == "units" else 0
    for slot in range(rank * workers, (rank + 1) * workers):
        if last["delivered"][slot] is None:
            known = base["stages"][-1]["delivered"][slot] if same else None
            last["delivered"][slot] = zero if known is None else known
    return state
