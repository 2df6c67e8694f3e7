"""Where this process stands: DDP rank and world size, DataLoader worker and worker count; or a
world given for a block of code (:func:`pinned`: one of n read tasks of a distributed engine)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from streamdata.config import env_int
from streamdata.errors import SpecError
from streamdata.ranks import DataParallel

__all__ = ["World", "pinned"]

_pinned = threading.local()  # the world :func:`pinned` gives this thread, if any


@dataclass(frozen=True)
class World:
    """One reader's place among all readers of an epoch.

    ``num_workers`` is at least 1: ``DataLoader(num_workers=0)`` reads in the main process,
    which counts as the single worker 0.
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size) or not (0 <= self.worker < self.num_workers):
            raise SpecError(f"inconsistent world: {self}")

    @property
    def slot(self) -> int:
        """This reader's index among all ``world_size * num_workers`` readers."""
        return self.rank * self.num_workers + self.worker

    @property
    def slots(self) -> int:
        return self.world_size * self.num_workers

    def describe(self) -> str:
        return f"rank {self.rank}/{self.world_size}, worker {self.worker}/{self.num_workers}"

    @classmethod
    def current(cls, dp: DataParallel | None = None) -> World:
        """Derive the world once: the one :func:`pinned` gives this thread, else the data-parallel
        place ``dp`` (the replicas are the ranks that split the data), else torch.distributed if
        initialised, else RANK/WORLD_SIZE, else 1."""
        given = getattr(_pinned, "world", None)
        if given is not None:
            return given
        import torch.distributed as dist
        from torch.utils.data import get_worker_info

        if dp is not None:  # REPLICA-PLAN: every rank of replica dp.rank reads that replica's plan
            rank, world_size = dp.rank, dp.size
        elif dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            rank, world_size = env_int("RANK", 0) or 0, env_int("WORLD_SIZE", 1) or 0  # (never None)
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return cls(rank=rank, world_size=world_size, worker=worker, num_workers=num_workers)


@contextlib.contextmanager
def pinned(world: World) -> Iterator[World]:
    """Within the block, on this thread, :meth:`World.current` is ``world``: a reader that is not
    a DDP rank nor a DataLoader worker (a Ray read task, ``integrations.ray``) reads its share of
    the epoch as reader ``world.slot`` of ``world.slots``."""
    before = getattr(_pinned, "world", None)
    _pinned.world = world
    try:
        yield world
    finally:
        _pinned.world = before
