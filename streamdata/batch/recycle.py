"""Recycled shared-memory batch buffers: a worker reuses a batch's ``/dev/shm`` storage once
the main process has let go of it.

Why: a fresh shared-memory storage costs its first writer a page fault per 4 KiB page (tmpfs
allocates and zeroes the page then), and a worker streaming small samples spends much of its
time there; a storage written before costs none (benchmarks/README.md, "Large arrays through
the worker pipe").

RECYCLE-HANDOFF (the invariant): the main process and every worker share a board of slot
states (``Board``: int64 ``[num_workers, slots]``).  A worker writes into a slot's storage
only while the board says ``FREE`` (0), and sets the slot to a fresh token before the
storage goes into a batch.  The main process sets it back to ``FREE`` only when (a) it has
unpickled the batch carrying that token (``_Lent.__setstate__`` registers it), (b) every
reference to the storage in the main process is gone (torch's weak storage reference has
expired: the user dropped the batch, or the pinning thread copied it), and (c) the board
still holds that token (a restarted worker's slots carry other tokens).  Each side writes a
slot only in the state the other side does not write, so plain loads and stores suffice.

MAPPED-ONCE: a pooled storage crosses to the main process by descriptor once per allocation
(torch's fd hand-over: a round trip to the worker's resource-sharer thread and an ``mmap``,
per storage and batch); the main process keeps that mapping on the board (``Board.mapped``,
by worker, slot and the storage's generation), and a later batch in the same storage carries
only its slot, generation and each tensor's view (``_Ref``), rebuilt there on the mapping by the
unpickler itself (no walk over the batch: its tickets say which slots came so). So
(b) above reads: nothing in the main process but that mapping holds the storage. A worker
that lets a storage go tells the main process in its next batch (``forget``), which drops the
mapping.

A batch sent anywhere else than the main process (another ``multiprocessing`` queue) is
not tracked: pass ``recycle_buffers=False`` to :func:`streamdata.loader` for such pipelines.
"""

from __future__ import annotations

import random
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn

import torch

from streamdata._compat import storage_use_count
from streamdata._fork import at_fork_in_child
from streamdata.batch.tree import iter_tensors, map_kinds, map_tensors, pin_batch

__all__ = ["Board", "BufferPool", "active_pool", "install", "lend", "lent_count", "reclaim", "unwrap"]

FREE = 0
SLOTS_PER_WORKER = 64  # storages a worker keeps; a batch's array fields share one (``empty_tensors``)
_REUSE_SLACK = 2  # a free storage serves a request of at least 1/_REUSE_SLACK of its size
# A free storage not reused in this many requests is dropped: the pool keeps what the
# batches in flight need, not the peak of a moment when the loop held many batches, nor
# storages of sizes that stopped coming (variable-length batches). Each request takes one
# slot, so a storage the batches in flight keep using comes back within SLOTS_PER_WORKER.
IDLE_REQUESTS = 2 * SLOTS_PER_WORKER


class Board:
    """Slot states shared by the main process and the workers of one loader."""

    def __init__(self, num_workers: int, slots: int = SLOTS_PER_WORKER) -> None:
        self.id = random.getrandbits(62)
        self.states = torch.zeros((max(1, num_workers), slots), dtype=torch.int64).share_memory_()
        self._view = self.states.numpy()  # the same memory: a slot read or written without torch's indexing
        # MAPPED-ONCE, main process: (worker, slot) -> (generation, the storage's mapping here)
        self.mapped: dict[tuple[int, int], tuple[int, torch.UntypedStorage]] = {}
        _BOARDS[self.id] = self  # the main process's registry, found by id when batches arrive

    def release(self, worker: int, slot: int, token: int) -> bool:
        """Main process: mark the slot free if it still carries ``token`` (RECYCLE-HANDOFF)."""
        view = self._view
        if view[worker, slot] != token:
            return False
        view[worker, slot] = FREE
        return True

    def close(self) -> None:
        _BOARDS.pop(self.id, None)
        with _LOCK:
            self.mapped.clear()

    def __getstate__(self) -> dict:  # a spawned worker needs the states, not the mappings
        return {**self.__dict__, "mapped": {}, "_view": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._view = self.states.numpy()


class _Slot:
    __slots__ = ("gen", "index", "last_used", "nbytes", "sent", "storage", "token")

    def __init__(self, index: int, storage: torch.UntypedStorage, gen: int) -> None:
        self.index, self.storage, self.nbytes, self.token = index, storage, storage.nbytes(), FREE
        self.last_used = 0  # the pool's request count when it was last handed out
        self.gen = gen  # which allocation of this slot (MAPPED-ONCE)
        self.sent = False  # crossed to the main process (by descriptor) already


class _Ref:
    """A tensor in a storage the main process has mapped already (MAPPED-ONCE): its view.

    Pickled, it is rebuilt by the unpickler itself as that view (:func:`_ref_tensor`), so the
    main process does not walk the batch to find it. (A ``_Ref`` set up from a state of its
    own, ``__setstate__``, is rebuilt by the walk of :func:`_register`.)"""

    __slots__ = ("board_id", "dtype", "gen", "offset", "size", "slot", "stride", "worker")

    def __init__(self, slot: _Slot, tensor: torch.Tensor, board_id: int = 0, worker: int = 0) -> None:
        self.slot, self.gen, self.dtype = slot.index, slot.gen, tensor.dtype
        self.size, self.stride, self.offset = tuple(tensor.shape), tensor.stride(), tensor.storage_offset()
        self.board_id, self.worker = board_id, worker

    def __reduce__(self) -> tuple:
        return _ref_tensor, (self.board_id, self.worker, self.slot, self.gen, self.dtype, self.size,
                             self.stride, self.offset)

    def __setstate__(self, state: tuple) -> None:
        self.slot, self.gen, self.dtype, self.size, self.stride, self.offset = state


class BufferPool:
    """Worker side: shared-memory storages handed to batches and taken back when freed."""

    def __init__(self, board: Board, worker: int) -> None:
        self.board_id, self.worker = board.id, worker
        self._row = board.states[worker].numpy()  # a view of the shared board, not a copy
        # The board is this worker process's alone: sd.loader makes a new one for every set
        # of worker processes (each epoch without persistent workers), so two live processes
        # with the same worker id never share a row. What is left here is not ours.
        self._row[:] = FREE
        self._slots: list[_Slot | None] = [None] * len(self._row)
        self._pending: list[_Slot] = []  # handed out, not yet seen in a batch sent out
        self._incarnation = random.getrandbits(30) << 32
        self._counter = 0
        self._allocations = 0
        self._forgotten: list[tuple[int, int]] = []  # (slot, generation) let go, the main not told yet
        self.stats = {"reused": 0, "allocated": 0, "unpooled": 0, "dropped": 0}

    def storage(self, nbytes: int, allocate: Any) -> torch.UntypedStorage:
        """A shared-memory storage of at least ``nbytes``: a free one, else ``allocate(n)``."""
        slot = self._free_slot(nbytes)
        if slot is not None:
            self.stats["reused"] += 1
        else:
            index = self._index_for_new()
            if index is None:  # every slot is out with a batch: a storage of its own
                self.stats["unpooled"] += 1
                return allocate(nbytes)
            self._allocations += 1
            slot = _Slot(index, allocate(nbytes), self._incarnation | self._allocations)
            self._slots[index] = slot
            self.stats["allocated"] += 1
        self._counter += 1
        slot.last_used = self._counter
        slot.token = self._incarnation | self._counter
        self._row[slot.index] = slot.token
        self._pending.append(slot)
        return slot.storage

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the storages this pool keeps (lent or free)."""
        return sum(slot.nbytes for slot in self._slots if slot is not None)

    @staticmethod
    def _only_pool_holds(slot: _Slot) -> bool:
        return storage_use_count(slot.storage) == 1

    def _idle(self, slot: _Slot) -> bool:
        """Free on the board and held by nothing but the pool."""
        return self._row[slot.index] == FREE and self._only_pool_holds(slot)

    def _free_slot(self, nbytes: int) -> _Slot | None:
        """The smallest fitting slot that the main process freed and nothing here still uses
        (a dataset may keep earlier batches: mixup, a replay buffer). In the same pass, idle
        storages unused for ``IDLE_REQUESTS`` requests are let go (unmapped once nothing
        holds them), so the pool shrinks back to what the batches in flight use."""
        best = None
        for index, slot in enumerate(self._slots):
            if slot is None or not self._idle(slot):
                continue
            if self._counter - slot.last_used >= IDLE_REQUESTS:
                self._let_go(index)
                self.stats["dropped"] += 1
            elif (nbytes <= slot.nbytes <= nbytes * _REUSE_SLACK
                  and (best is None or slot.nbytes < best.nbytes)):
                best = slot
        return best

    def _index_for_new(self) -> int | None:
        """An unused slot index, else one whose free storage has the wrong size (dropped)."""
        spare = None
        for index, slot in enumerate(self._slots):
            if slot is None:
                return index
            if spare is None and self._row[index] == FREE:
                spare = index
        if spare is not None:
            self._let_go(spare)  # its storage is unmapped here once nothing holds it
        return spare

    def _let_go(self, index: int) -> None:
        slot, self._slots[index] = self._slots[index], None
        if slot is not None and slot.sent:  # the main process keeps its mapping till told
            self._forgotten.append((index, slot.gen))

    def lend(self, batch: Any) -> Any:
        """Wrap ``batch`` with the tokens of the pooled storages its tensors use."""
        if not self._pending:
            return batch
        by_ptr = {slot.storage.data_ptr(): slot for slot in self._pending}
        tickets, seen, slots = [], set(), []
        for position, tensor in enumerate(iter_tensors(batch)):
            slot = by_ptr.get(tensor.untyped_storage().data_ptr()) if tensor.device.type == "cpu" else None
            if slot is not None and slot.index not in seen:
                seen.add(slot.index)
                slots.append(slot)
                tickets.append((position, slot.index, slot.token, slot.gen))
        still = []
        for slot in self._pending:
            if slot.index in seen:
                continue
            if self._only_pool_holds(slot):  # dropped before sending
                self._row[slot.index] = FREE
            else:
                still.append(slot)
        self._pending = still
        if not tickets:
            return batch
        forget, self._forgotten = self._forgotten, []
        return _Lent(batch, self.board_id, self.worker, tickets, slots, forget)


class _Lent:
    """A batch crossing from a worker, with the pool slots its tensors live in.

    Pickled (the worker's queue), a tensor in a slot the main process has mapped already goes
    as a ``_Ref`` (MAPPED-ONCE); the others go by descriptor, and their slots count as mapped
    from then on. Unpickling it in the main process rebuilds the tensors, keeps new mappings
    and registers the slots for release; :func:`unwrap` returns the batch itself. The
    DataLoader's pinning thread calls :meth:`pin_memory`.

    Its state names the tickets whose tensors went as ``_Ref`` (``refs``): the unpickler rebuilt
    those on the board's mappings already, so registering them reads no tensor; only a batch
    with a storage that came by descriptor is walked (once per allocation of a slot).
    """

    __slots__ = ("_slots", "batch", "board_id", "forget", "tickets", "worker")

    def __init__(self, batch: Any, board_id: int, worker: int, tickets: list[tuple[int, int, int, int]],
                 slots: list[_Slot] | None = None, forget: list[tuple[int, int]] | None = None) -> None:
        self.batch, self.board_id, self.worker, self.tickets = batch, board_id, worker, tickets
        self._slots, self.forget = slots or [], forget or []

    def __getstate__(self) -> tuple[Any, ...]:
        batch = self.batch
        refs: tuple[int, ...] = ()
        if self._slots:  # in the worker, as the batch is pickled to be sent: MAPPED-ONCE
            mapped = {slot.storage.data_ptr(): slot for slot in self._slots if slot.sent}
            if mapped:
                board_id, worker = self.board_id, self.worker
                batch = map_tensors(lambda t: _as_ref(mapped, t, board_id, worker), batch)
                sent = {slot.index for slot in mapped.values()}
                refs = tuple(i for i, (_, slot, _, _) in enumerate(self.tickets) if slot in sent)
            for slot in self._slots:
                slot.sent = True
        return batch, self.board_id, self.worker, self.tickets, self.forget, refs

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.batch, self.board_id, self.worker, self.tickets, self.forget = state[:5]
        self._slots = []
        _register(self, state[5] if len(state) > 5 else None)

    def pin_memory(self) -> Any:
        return pin_batch(self.batch)  # the shared-memory storages are dropped after the copy


# --- the worker's pool -------------------------------------------------------------------------

_POOL: BufferPool | None = None


def install(board: Board, worker: int) -> None:
    """In a worker (from ``worker_init_fn``): batch storages come from a pool on ``board``."""
    global _POOL
    _POOL = BufferPool(board, worker)


def active_pool() -> BufferPool | None:
    """This worker's pool, or ``None`` (main process, a loader without recycling, or a process
    forked from a worker: FORK-RESET drops the pool there)."""
    return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None


at_fork_in_child("pools", _forget_pool)


def lend(batch: Any) -> Any:
    """In a worker: ``batch`` wrapped with its pool slots (as is without a pool)."""
    pool = active_pool()
    return pool.lend(batch) if pool is not None else batch


# --- the main process's side -------------------------------------------------------------------

_BOARDS: weakref.WeakValueDictionary[int, Board] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()  # the pinning thread registers while the main thread reclaims
# lent slots: (board id, worker, slot, token) -> (the storage's mapping here, board); one record each
_OUT: dict[tuple[int, int, int, int], tuple[Any, Board]] = {}
# _register reclaims when _OUT has grown to _prune_at (nobody calls reclaim when the batches
# are read from ``loader.dataloader``): a pool lends at most SLOTS_PER_WORKER slots, and a batch
# takes one for its array fields and one per field collated at its end (labels), so the trigger
# comes _PRUNE_MIN entries after what was
# still live at the last reclaim (a walk over at most the slots lent, every _PRUNE_MIN batches)
_PRUNE_MIN = 16
_prune_at = _PRUNE_MIN


def _as_ref(mapped: dict[int, _Slot], tensor: torch.Tensor, board_id: int, worker: int) -> Any:
    """Worker side: ``tensor`` as a ``_Ref`` if it lives in a slot the main process has mapped."""
    if tensor.device.type != "cpu":
        return tensor
    slot = mapped.get(tensor.untyped_storage().data_ptr())
    return tensor if slot is None else _Ref(slot, tensor, board_id, worker)


def _ref_tensor(board_id: int, worker: int, slot: int, gen: int, dtype: torch.dtype, size: tuple,
                stride: tuple, offset: int) -> torch.Tensor:
    """Main process, as a batch is unpickled: the tensor a pickled ``_Ref`` stands for."""
    board = _BOARDS.get(board_id)
    held = board.mapped.get((worker, slot)) if board is not None else None
    if held is None or held[0] != gen:
        _refused(worker, slot)
    return torch.empty(0, dtype=dtype).set_(held[1], offset, size, stride)


def _rebuilt(board: Board | None, worker: int, ref: _Ref) -> torch.Tensor:
    """Main process: the tensor a ``_Ref`` stands for, on the board's mapping of its slot."""
    held = board.mapped.get((worker, ref.slot)) if board is not None else None
    if held is None or held[0] != ref.gen:
        _refused(worker, ref.slot)
    return torch.empty(0, dtype=ref.dtype).set_(held[1], ref.offset, ref.size, ref.stride)


def _refused(worker: int, slot: int) -> NoReturn:
    from streamdata.errors import StreamDataError

    raise StreamDataError(
        f"a batch from DataLoader worker {worker} refers to a shared-memory buffer (slot "
        f"{slot}) that this process has not received: batches of a recycling loader can "
        "be unpickled only by the process that runs it; pass recycle_buffers=False to "
        "sd.loader to send them elsewhere")


def _register(lent: _Lent, refs: tuple[int, ...] | None = None) -> None:
    """Main process, as ``lent`` is unpickled: keep the mappings of the storages that came by
    descriptor, drop those the worker let go, and record every lent slot as out. The tickets in
    ``refs`` came as ``_Ref``, rebuilt on the board's mappings by the unpickler: recorded from
    the board without reading the batch; the batch is walked only when some other ticket (or a
    ``_Ref`` not rebuilt yet: ``refs`` None) is left."""
    board = _BOARDS.get(lent.board_id)
    worker = lent.worker
    with _LOCK:
        if refs is None:
            lent.batch = map_kinds(lambda ref: _rebuilt(board, worker, ref), lent.batch, (_Ref,))
        if board is None:  # not unpickled by the loader that owns the board: never released
            return
        mapped = board.mapped
        for slot, gen in lent.forget:  # storages the worker let go: their mappings here too
            if mapped.get((worker, slot), (None,))[0] == gen:
                del mapped[(worker, slot)]
        tickets = lent.tickets
        if refs:
            for i in refs:
                _, slot, token, _ = tickets[i]
                held = mapped.get((worker, slot))  # its tensors were rebuilt on it (generation checked)
                if held is not None:  # the same batch unpickled twice: one record is enough
                    _OUT.setdefault((board.id, worker, slot, token), (held[1], board))
            if len(refs) < len(tickets):
                tickets = [t for i, t in enumerate(tickets) if i not in refs]
            else:
                tickets = []
        if tickets:
            _register_walked(lent, board, tickets)
        grown = len(_OUT) >= _prune_at
    if grown:
        reclaim()


def _register_walked(lent: _Lent, board: Board, tickets: list[tuple[int, int, int, int]]) -> None:
    """``_register`` for the tickets found by walking the batch (under ``_LOCK``)."""
    positions = {position: (slot, token, gen) for position, slot, token, gen in tickets}
    for position, tensor in enumerate(iter_tensors(lent.batch)):
        if position not in positions or not tensor.is_shared():
            # a copy (``copy.deepcopy``, a plain pickle round trip) has private storage: only
            # the batch that really lives in the slot may hold it out of the pool
            continue
        slot, token, gen = positions[position]
        held = board.mapped.get((lent.worker, slot))
        if held is None or held[0] != gen:  # it came by descriptor: keep the mapping (MAPPED-ONCE)
            held = board.mapped[(lent.worker, slot)] = (gen, tensor.untyped_storage())
        # the same batch unpickled twice: one record is enough
        _OUT.setdefault((board.id, lent.worker, slot, token), (held[1], board))


def lent_count() -> int:
    """Main process: slots registered as out with a batch and not yet released."""
    with _LOCK:
        return len(_OUT)


def reclaim() -> int:
    """Main process: release the slots of batches no longer referenced; how many were."""
    global _prune_at
    released = 0
    with _LOCK:
        for key, (storage, board) in list(_OUT.items()):
            if storage_use_count(storage) <= 1:  # nothing but the mapping holds it
                released += board.release(*key[1:])
                del _OUT[key]
        _prune_at = len(_OUT) + _PRUNE_MIN
    return released


def unwrap(batches: Iterable[Any]) -> Iterator[Any]:
    """The batches of a recycling DataLoader, unwrapped, releasing freed slots as they go.

    The DataLoader's iterator is created now (its workers start fetching), not at the
    first ``next``.
    """
    return _unwrapped(iter(batches))


def _unwrapped(items: Iterator[Any]) -> Iterator[Any]:
    for item in items:
        reclaim()
        yield item.batch if isinstance(item, _Lent) else item
