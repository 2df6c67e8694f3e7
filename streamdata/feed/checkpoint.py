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
"""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from typing import Any, NamedTuple

from streamdata.epoch.state import merge_states
from streamdata.epoch.world import World
from streamdata.errors import SpecError

__all__ = ["Positioned", "Positions", "Stripped", "Tagged"]


class Tagged(NamedTuple):
    """A batch on its way from a worker, with the state of the worker's dataset after it."""

    batch: Any
    worker: int
    state: dict | None


class Positioned:
    """A picklable ``collate_fn``: the caller's, its batch tagged with the reader's state."""

    def __init__(self, collate_fn: Any, dataset: Any) -> None:
        self.collate_fn, self.dataset = collate_fn, dataset

    def __call__(self, samples: Any) -> Tagged:
        from torch.utils.data import get_worker_info

        batch = self.collate_fn(samples)
        info = get_worker_info()
        dataset: Any = info.dataset if info is not None else self.dataset
        return Tagged(batch, 0 if info is None else info.id, dataset.state_dict())


class Positions:
    """The latest state each worker's delivered batch carried, on the main process's side."""

    def __init__(self, dataset: Any, num_workers: int) -> None:
        self.dataset, self.num_workers = dataset, max(num_workers, 1)
        self.latest: dict[int, dict] = {}
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
            if tag is not None and tag.state is not None:
                self.latest[tag.worker] = tag.state
            yield item.batch if isinstance(item, Tagged) else item

    def state_dict(self) -> dict:
        """Every reader's position: this rank's workers, and every rank's when torch.distributed
        is initialised (a collective: call it on every rank)."""
        import torch.distributed as dist

        base = self.dataset.state_dict()  # the epoch's start, or the position loaded
        mine = [s for s in self.latest.values() if s.get("epoch") == max(
            x.get("epoch", 0) for x in self.latest.values())]
        state = merge_states(mine) if mine else base
        state = _fill(state, base, World.current().rank)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, state)
            state = merge_states(every)
        return json.loads(json.dumps(state))

    def load_state_dict(self, state: dict, started: bool) -> None:
        if started:
            raise SpecError("load_state_dict() must come before the loader's first iteration "
                            "(its workers read the position when they start)")
        self.dataset.load_state_dict(state)
        self.latest.clear()

    def reset(self) -> None:
        self.latest.clear()


class Stripped:
    """An iterable of tagged batches, stripped (:meth:`Positions.strip`): what the GPU feed
    reads, so that its ``transform`` sees the batches themselves."""

    def __init__(self, source: Any, positions: Positions) -> None:
        self.source, self.positions = source, positions

    def __iter__(self) -> Iterator[Any]:
        return self.positions.strip(iter(self.source))

    def __len__(self) -> int:
        return len(self.source)


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
