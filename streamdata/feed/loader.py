"""``sd.loader``: a DataLoader preset choosing workers, prefetch, pinning and the GPU feed together."""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, IterableDataset

from streamdata._alloc import keep_freed_memory
from streamdata._compat import (
    dataloader_iterator,
    detach_dataloader_iterator,
    shutdown_workers,
    worker_processes,
)
from streamdata._fork import install
from streamdata.batch import recycle
from streamdata.batch.batches import batches
from streamdata.batch.collate import DEFAULT_PREFETCH_FACTOR, collate, to_tensors
from streamdata.epoch.state import STATE_FORMAT
from streamdata.errors import SpecError
from streamdata.feed.checkpoint import Positioned, Positions, Stripped, held_ahead_of
from streamdata.feed.cuda import CudaPrefetcher
from streamdata.feed.metrics import Metrics, Stopwatch, gather_ranks, reporter, summary
from streamdata.feed.together import EndTogether
from streamdata.ranks import data_parallel

__all__ = ["DEFAULT_PREFETCH_FACTOR", "Loader", "default_num_workers", "loader"]

_MAX_DEFAULT_WORKERS = 4
_JOIN_TIMEOUT = 10.0  # seconds close() waits for each worker that is still ending
_UNSET: Any = object()

log = logging.getLogger("streamdata")


def default_num_workers() -> int:
    """Workers used when the caller does not say: one per usable CPU core, at most four."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return min(_MAX_DEFAULT_WORKERS, cpus)


class _WorkerInit:
    """A picklable ``worker_init_fn``: freeze what the worker inherited from the collector and
    keep freed memory (WORKER-MEMORY), set the sharing
    strategy, install the buffer pool, then call the user's function.

    The strategy is set in every worker because spawned (and forkserver) workers start with
    the default one, and the strategy that matters is the sending worker's.
    """

    def __init__(self, strategy: str | None, user_fn: Callable[[int], None] | None,
                 board: recycle.Board | None = None, keep_memory: bool = False) -> None:
        self.strategy, self.user_fn, self.board, self.keep_memory = strategy, user_fn, board, keep_memory

    def __call__(self, worker_id: int) -> None:
        if self.keep_memory:
            # for spawned / forkserver workers, what INHERITED-HEAP (``_alloc``) does at a fork:
            # what the worker has imported so far is out of its collector's sight (O(1))
            gc.freeze()
            keep_freed_memory()
        if self.strategy is not None:
            torch.multiprocessing.set_sharing_strategy(self.strategy)
        if self.board is not None:
            recycle.install(self.board, worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)


class _Lending:
    """A picklable ``collate_fn``: the caller's, its batch then wrapped with its pool slots."""

    def __init__(self, collate_fn: Callable[[Any], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: Any) -> Any:
        return recycle.lend(self.collate_fn(samples))


class _BatchedInWorkers(IterableDataset):
    """A per-sample IterableDataset batched inside each worker, each sample collated into
    the batch as it arrives (:mod:`streamdata.batch.batches`), or by the caller's ``collate_fn``:
    what ``sd.loader`` hands the DataLoader (with ``batch_size=None``). A streamdata dataset
    batches with its plan's sizes (EQUAL-STEPS), and its ``len()`` is its plan's steps with
    ``num_workers`` readers."""

    _FIELDS = ("dataset", "batch_size", "drop_last", "in_flight", "collate_fn", "num_workers")

    def __init__(self, dataset: IterableDataset, batch_size: int, drop_last: bool,
                 in_flight: int, collate_fn: Callable[[list], Any] | None = None,
                 num_workers: int = 0) -> None:
        self.dataset, self.batch_size, self.drop_last, self.in_flight = (
            dataset, batch_size, drop_last, in_flight)
        self.collate_fn, self.num_workers = collate_fn, num_workers

    def __getattr__(self, name: str) -> Any:  # worker_init_fn may read the user's dataset's
        try:  # attributes through get_worker_info().dataset
            dataset = self.__dict__["dataset"]
        except KeyError:  # while unpickling (spawn), before __dict__ is filled
            raise AttributeError(name) from None
        return getattr(dataset, name)

    def __setattr__(self, name: str, value: Any) -> None:  # ... and set them (start/end splits)
        if name in self._FIELDS:
            object.__setattr__(self, name, value)
        else:
            setattr(self.dataset, name, value)

    def __iter__(self) -> Iterator[Any]:
        iter_batches = getattr(self.dataset, "iter_batches", None)
        if iter_batches is not None:  # a sharded dataset batches with its plan (EQUAL-STEPS)
            return iter_batches(self.batch_size, drop_last=self.drop_last, collate_fn=self.collate_fn,
                                in_flight=self.in_flight)
        return batches(iter(self.dataset), self.batch_size, collate_fn=self.collate_fn,
                       drop_last=self.drop_last, in_flight=self.in_flight)

    def __len__(self) -> int:  # as DataLoader counts batches of an IterableDataset
        steps = getattr(self.dataset, "steps", None)
        if steps is not None:  # the plan's: every reader's batches, this rank's share of the epoch
            return int(steps(self.batch_size, self.drop_last, num_workers=self.num_workers))
        n = len(self.dataset)  # type: ignore[arg-type]  # TypeError when it has no len
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


def _as_is(batch: Any) -> Any:
    return batch


class _Unwrapped:
    """The DataLoader's batches as the user sees them (see :func:`recycle.unwrap`).

    Without persistent workers every iterator starts new worker processes, and two
    iterators may be alive at once (``zip(loader, loader)``): each set of workers gets a
    board of its own, made here before the iterator starts them (RECYCLE-HANDOFF).
    """

    def __init__(self, dataloader: DataLoader, init: _WorkerInit) -> None:
        self.dataloader, self.init = dataloader, init
        # every board made for this loader, closed with it (made only where init has one)
        self.boards: list[recycle.Board] = [init.board] if init.board is not None else []
        self._started = False

    def __iter__(self) -> Iterator[Any]:
        new_workers = (not self.dataloader.persistent_workers
                       or dataloader_iterator(self.dataloader) is None)
        if new_workers and self._started:
            self.init.board = recycle.Board(self.dataloader.num_workers)
            self.boards.append(self.init.board)
        self._started = True
        return recycle.unwrap(self.dataloader)

    def close(self) -> None:
        for board in self.boards:
            board.close()

    def __len__(self) -> int:
        return len(self.dataloader)


class Loader:
    """What :func:`loader` returns: iterate it once per epoch.

    ``len()``: this rank's batches of the epoch where the plan knows them (a streamdata dataset
    with sample counts: ``ShardedDataset.steps``), else the DataLoader's; ``set_epoch`` reaches
    the dataset in this process (persistent workers hold their own copy: the dataset must make
    the epoch reach them, as streamdata's datasets do); ``close()`` ends the prefetcher and the workers.
    An iterator starts nothing (workers, requests) before its first ``next()``:
    a framework's probing ``iter()`` costs nothing and leaves the epoch as it was.
    """

    sampler = None  # the dataset splits itself: nothing for a framework to replace or set an epoch on

    def __init__(self, dataloader: DataLoader, feed: CudaPrefetcher[Any] | None = None,
                 batches: _Unwrapped | None = None, *, dataset: Any = None,
                 end_together: bool = True, positions: Positions | None = None,
                 log_every: int | None = None, on_metrics: Callable[[Metrics], None] | None = None,
                 held_ahead: int | None = None) -> None:
        if log_every is not None and log_every < 1:
            raise SpecError(f"log_every must be >= 1 or None, got {log_every}")
        if on_metrics is not None and log_every is None:
            raise SpecError("on_metrics needs log_every: the steps between two calls")
        self.dataloader = dataloader
        self.dataset = dataloader.dataset if dataset is None else dataset
        self.prefetcher = feed
        self._batches = batches  # with recycled buffers: unwraps, and owns the boards
        self._source: Any = feed if feed is not None else batches if batches is not None else dataloader
        self._together = EndTogether() if end_together else None
        self._positions = positions  # mid-epoch resume (``checkpoint``)
        self._running = 0  # iterations started and not ended
        self._held_ahead_given = held_ahead  # None: each iteration finds it (HELD-AHEAD-DETECTED)
        self._held_ahead = held_ahead
        self._held_ahead_logged: tuple[int, str | None] | None = None
        self.stopwatch = Stopwatch(log_every or 0, reporter(log_every, on_metrics, self.metrics))

    @property
    def board(self) -> recycle.Board | None:
        """The board of the workers started last (``None`` without recycled buffers)."""
        return self._batches.init.board if self._batches is not None else None

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        """One pass, started at the first ``next()``."""
        self._hold_ahead(sys._getframe(1))  # the frame asking for the first batch (HELD-AHEAD-DETECTED)
        install()  # FORK-RESET and INHERITED-HEAP for the workers this may start (``_fork``)
        self._running += 1
        try:
            if self._positions is not None:
                self._positions.begin()  # (before the workers start)
            source = iter(self._source)
            if self._positions is not None:
                source = self._positions.deliver(source)
            if self._together is not None and self._together.active():
                source = self._together.wrap(source)  # END-TOGETHER
            yield from self.stopwatch.wrap(source)
            if self._positions is not None:
                self._positions.end()  # CONSUMED-POSITION: the state is the next epoch's start
        finally:
            self._running -= 1

    @property
    def held_ahead(self) -> int | None:
        """The batches ``state_dict()`` leaves out as held ahead of the training step while an
        iteration runs (CONSUMED-POSITION): the ``held_ahead`` given, else what the latest
        iteration found as its first batch was asked for (HELD-AHEAD-DETECTED, in
        ``feed/checkpoint.py``); None before that when none was given."""
        return self._held_ahead

    def _hold_ahead(self, caller: Any) -> None:
        """An iteration's first ``next()``: the ``held_ahead`` given, else found from ``caller``."""
        held, by = self._held_ahead_given, None
        if held is None:
            held, by = held_ahead_of(caller)
        self._held_ahead = held
        if self._positions is not None:
            self._positions.held_ahead = held
        if (held, by) == self._held_ahead_logged:  # logged once, and again when it changes
            return
        self._held_ahead_logged = (held, by)
        if by is not None:
            log.info("sd.loader: held_ahead=%d: %s holds that many batches ahead of the training step; "
                     "state_dict() leaves them out until the epoch's iteration ends", held, by)
        else:
            log.debug("sd.loader: held_ahead=%d (%s)", held, "given" if self._held_ahead_given is not None
                      else "nothing known iterates the loader ahead of the step")

    def metrics(self, all_ranks: bool = False) -> Metrics:
        """Is the training loop waiting for data? A flat, JSON-ready dict (docs/metrics.md):
        ``steps``, ``wall_s``, ``data_wait_s``, ``first_batch_s``, ``stall_fraction``, the
        readers' ``stage.*_s`` summed over workers, ``samples``, ``bytes``, ``requests``,
        ``retries``, the dataset's counters and a ``verdict``. ``all_ranks=True`` (a collective:
        call it on every rank) gathers every rank's: ``{"ranks": [...], "straggler": rank, ...}``."""
        mine = summary(self.stopwatch, self.dataset, self.prefetcher)
        return gather_ranks(mine) if all_ranks else mine

    def state_dict(self) -> dict:
        """Every reader's position in the epoch, as plain data: with torch.distributed, every
        rank's (a collective: call it on every rank), so one rank's saved state restarts any
        world size (docs/resume.md)."""
        if self._positions is None:
            raise AttributeError(f"{type(self.dataset).__name__} has no state_dict()")
        return self._positions.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume the saved epoch at the saved position: call it before the loader delivers its
        first batch. Workers an iteration started without delivering a batch (a framework's probe)
        read the old position: they are shut down, and the next iteration starts new ones."""
        if self._positions is None:
            raise AttributeError(f"{type(self.dataset).__name__} has no load_state_dict()")
        self._positions.load_state_dict(state)
        self._end_workers()

    @property
    def undelivered(self) -> int:
        """Samples of the last epoch this rank read but did not deliver because another rank
        had run out (END-TOGETHER); 0 in a single-process job."""
        return self._together.undelivered if self._together is not None else 0

    def __len__(self) -> int:
        return len(self.dataloader)

    @property
    def skipped(self) -> dict[str, int]:
        """The dataset's skips under ``on_error`` per reason, over every worker (``{}`` for a
        dataset that does not count them)."""
        return dict(getattr(self.dataset, "skipped", {}))

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch to ``dataset.set_epoch``; call it before iterating the epoch."""
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is None:
            raise AttributeError(f"{type(self.dataset).__name__} has no set_epoch()")
        if self._running and epoch == getattr(self.dataset, "epoch", None):
            return  # the epoch being read (a framework that sets it after taking the first batch)
        set_epoch(epoch)
        if self._positions is not None:
            self._positions.reset()

    def close(self) -> None:
        """Stop the prefetcher's thread and shut the DataLoader's persistent workers down."""
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._batches is not None:
            self._batches.close()
        self._end_workers()

    def _end_workers(self) -> None:
        iterator = detach_dataloader_iterator(self.dataloader)  # torch keeps persistent workers there
        if iterator is not None:
            try:
                shutdown_workers(iterator)
            except RuntimeError as exc:
                # A spawned worker stopped mid-epoch can abort in its own interpreter
                # teardown ("killed by signal: Aborted"); it was ending anyway, as in
                # DataLoader's __del__, which ignores this too.
                if "killed by signal" not in str(exc):
                    raise
                for worker in worker_processes(iterator):  # reap the rest
                    worker.join(timeout=_JOIN_TIMEOUT)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def loader(
    dataset: Any,
    *,
    batch_size: int | None = _UNSET,
    num_workers: int | None = None,
    prefetch_factor: int | None = None,
    persistent_workers: bool | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[Any], Any] | None = None,
    sharing_strategy: str | None = None,
    device: str | torch.device | None = None,
    depth: int = 1,
    transform: Callable[[Any], Any] | None = None,
    recycle_buffers: bool = True,
    reuse_worker_memory: bool = True,
    end_together: bool = True,
    held_ahead: int | None = None,
    log_every: int | None = None,
    on_metrics: Callable[[dict], None] | None = None,
    dp_rank: int | None = None,
    dp_size: int | None = None,
    mesh: Any = None,
    group: Any = None,
    **dataloader_kwargs: Any,
) -> Loader:
    """A DataLoader with streaming defaults, optionally feeding a GPU; everything overridable.

    Defaults: ``num_workers`` one per core (at most 4); with workers, ``persistent_workers`` and
    ``prefetch_factor=2``; ``pin_memory`` when CUDA is available; ``batch_size=None`` when the
    dataset batches itself (a ``batch_size`` attribute that is not ``None``), else DataLoader's
    1; a ``collate_fn`` that builds tensors in the workers' shared memory and checks
    ``/dev/shm`` first (with workers, a per-sample IterableDataset is batched in the workers,
    each sample copied into its batch as it arrives: :func:`streamdata.batch.batches.batches`;
    a streamdata dataset is so without workers too, with its plan's batch sizes, EQUAL-STEPS;
    ``loader.dataloader`` then has ``batch_size=None``).  ``sharing_strategy="file_system"``
    sets that strategy here and in every worker.  ``device`` wraps the loader in a
    :class:`CudaPrefetcher` (``depth``, ``transform``).  ``recycle_buffers`` (with workers): a
    worker reuses the shared memory of batches the main process has dropped
    (:mod:`streamdata.batch.recycle`); iterate the returned ``Loader``, not its ``dataloader``.
    ``reuse_worker_memory`` (with workers, glibc): a worker keeps the memory it frees for the
    next epoch instead of giving it back to the OS and page-faulting it in again
    (:mod:`streamdata._alloc`).  ``end_together`` (a multi-rank job): every rank ends an
    epoch at the step where the first rank runs out of batches, so DDP never hangs on uneven
    data; what the other ranks did not deliver is counted in ``loader.undelivered``
    (:mod:`streamdata.feed.together`).  ``held_ahead``: batches the code iterating the loader
    takes ahead of the training step; ``state_dict()`` leaves them out until the epoch ends, so a
    resume reads them again.  ``None`` (the default): found as each epoch's first batch is asked
    for: Lightning's ``Trainer`` (1 when the loader has no ``len()``), Ray's
    ``prepare_data_loader`` wrapper (``move_to_device=True``: 1), else 0 (a plain loop, Fabric,
    accelerate); set it for other code that holds a fixed number of batches when the state is
    saved (a loop of your own that takes the next batch before the step: 1); ``loader.held_ahead``
    reads the value in use (docs/frameworks.md).  ``log_every`` (steps): every that many steps,
    ``on_metrics(loader.metrics())``, or without ``on_metrics`` a line on the ``streamdata``
    logger at INFO (docs/metrics.md).  ``dp_rank``/``dp_size``, ``mesh`` (the data-parallel
    dimension of a ``DeviceMesh``, ``mesh["dp"]``) or ``group`` (the data-parallel process group):
    with tensor, context or pipeline parallelism, only the data-parallel replicas split the epoch
    and the ranks of one replica get identical batches (docs/distributed.md).  Other keyword
    arguments go to ``DataLoader`` unchanged.
    """
    place = data_parallel(dp_rank, dp_size, mesh=mesh, group=group)
    if place is not None and (place.source == "given" or hasattr(dataset, "set_data_parallel")):
        if not hasattr(dataset, "set_data_parallel"):
            raise SpecError(f"{type(dataset).__name__} cannot be split by data-parallel group: dp_rank=, "
                            "mesh= and group= take a streamdata dataset (TarDataset, ParquetDataset, "
                            "TokenDataset, Mix ...)")
        dataset.set_data_parallel(place)
    if held_ahead is not None and (not isinstance(held_ahead, int) or held_ahead < 0):
        raise SpecError(f"held_ahead must be None (found as each epoch starts) or an int >= 0, "
                        f"got {held_ahead!r}")
    if batch_size is _UNSET:
        batch_size = None if getattr(dataset, "batch_size", None) is not None else 1
        if batch_size is None and "drop_last" in dataloader_kwargs:  # the dataset batches: its drop_last
            if bool(dataloader_kwargs.pop("drop_last")) != bool(getattr(dataset, "drop_last", False)):
                raise SpecError(f"{type(dataset).__name__} batches itself (batch_size={dataset.batch_size}): "
                                "give drop_last to it, or give sd.loader batch_size= with drop_last=")
    if num_workers is None:
        num_workers = default_num_workers()
    if num_workers > 0:
        prefetch_factor = DEFAULT_PREFETCH_FACTOR if prefetch_factor is None else prefetch_factor
        persistent_workers = True if persistent_workers is None else persistent_workers
    else:
        persistent_workers = bool(persistent_workers)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    served = dataset
    in_flight = max(1, num_workers * (prefetch_factor or 0))
    # with or without workers, a sharded dataset batches with its plan's sizes (EQUAL-STEPS), with
    # the caller's collate_fn too; other datasets in the workers with the default collation
    if (batch_size is not None and isinstance(dataset, IterableDataset)
            and (hasattr(dataset, "iter_batches") or num_workers > 0 and collate_fn is None)):
        served = _BatchedInWorkers(dataset, batch_size, bool(dataloader_kwargs.pop("drop_last", False)),
                                   in_flight, collate_fn, num_workers)
        batch_size, collate_fn = None, _as_is
    elif collate_fn is None:
        collate_fn = functools.partial(collate if batch_size is not None else to_tensors,
                                       in_flight=in_flight)
    if sharing_strategy is not None:
        if sharing_strategy not in torch.multiprocessing.get_all_sharing_strategies():
            raise SpecError(f"unknown sharing_strategy {sharing_strategy!r}; one of "
                            f"{sorted(torch.multiprocessing.get_all_sharing_strategies())}")
        torch.multiprocessing.set_sharing_strategy(sharing_strategy)
    positions = None
    if getattr(dataset, "state_format", None) == STATE_FORMAT:  # positions to resume (``checkpoint``)
        collate_fn, positions = Positioned(collate_fn, served), Positions(dataset, num_workers)
    board = recycle.Board(num_workers) if recycle_buffers and num_workers > 0 else None
    if board is not None:
        collate_fn = _Lending(collate_fn)
    init = None
    if num_workers > 0 and (sharing_strategy is not None or board is not None or reuse_worker_memory):
        user_init = dataloader_kwargs.pop("worker_init_fn", None)
        init = dataloader_kwargs["worker_init_fn"] = _WorkerInit(sharing_strategy, user_init, board,
                                                                 reuse_worker_memory)
    if persistent_workers and num_workers > 0 and hasattr(dataset, "early_next_epoch"):
        dataset.early_next_epoch = True  # workers start the next epoch's requests (NEXT-EPOCH-EARLY)
    dataloader = DataLoader(
        served,
        batch_size=batch_size,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
        pin_memory=pin_memory,
        collate_fn=collate_fn,
        **dataloader_kwargs,
    )
    unwrapped = _Unwrapped(dataloader, init) if init is not None and init.board is not None else None
    source = unwrapped if unwrapped is not None else dataloader
    # a DataLoader with workers that pins does so in a thread of its own: the prefetcher then needs
    # none; without workers (everything in this thread) its thread keeps the pass off the loop
    own_thread = not (pin_memory and num_workers > 0)
    feed = (CudaPrefetcher(source if positions is None else Stripped(source, positions), device, depth,
                           transform, thread=own_thread) if device is not None else None)
    return Loader(dataloader, feed, unwrapped, dataset=dataset, end_together=end_together,
                  positions=positions, log_every=log_every, on_metrics=on_metrics, held_ahead=held_ahead)
