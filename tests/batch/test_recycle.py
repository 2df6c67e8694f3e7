"""Recycled shared-memory batch buffers (streamdata/recycle.py, RECYCLE-HANDOFF).

Real DataLoader workers throughout: the property that matters is that a storage is reused
only after the main process let go of it, so a batch the training loop keeps is never
overwritten, and that storages are in fact reused when batches are dropped.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

from streamdata.batch import recycle
from streamdata.feed.loader import loader
from tests.helpers import in_forked_child

WIDTH = 2048  # float64 per sample: 16 KiB, a batch of 8 is 128 KiB


class Stamped(IterableDataset):
    """Samples whose every value is the sample's index, split between the workers."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield {"x": np.full(WIDTH, float(i)), "i": i}


def storage_inode(tensor: torch.Tensor) -> int:
    """The /dev/shm file behind a tensor received from a worker."""
    fd, _ = tensor.untyped_storage()._share_fd_cpu_()  # already shared: returns its own fd
    return os.fstat(fd).st_ino


def intact(batch: dict) -> bool:
    """Every row still holds the index it was made with."""
    return bool((batch["x"] == batch["i"].double()[:, None]).all())


def make(n_batches: int, **kwargs):
    kwargs = {"num_workers": 2, "pin_memory": False, "batch_size": 8, **kwargs}
    return loader(Stamped(8 * n_batches), **kwargs)


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_storage_of_dropped_batches_is_reused(context):
    n = 30
    with make(n, multiprocessing_context=context) as feed:
        inodes = []
        for batch in feed:
            assert intact(batch)
            inodes.append(storage_inode(batch["x"]))
    assert len(inodes) == n
    # Each worker keeps about prefetch_factor + 2 batches out at a time; the rest reuse.
    assert len(set(inodes)) <= 12, f"{len(set(inodes))} distinct storages for {n} batches"


def test_without_recycling_every_batch_has_a_new_storage():
    n = 12
    with make(n, recycle_buffers=False) as feed:
        inodes = {storage_inode(batch["x"]) for batch in feed}
    assert len(inodes) == n


@pytest.mark.parametrize("strategy", [None, "file_system"])
def test_batches_the_loop_keeps_are_never_overwritten(strategy, restore_sharing_strategy):
    n = 40
    with make(n, sharing_strategy=strategy) as feed:
        kept = []
        for k, batch in enumerate(feed):
            if k % 3 == 0:
                kept.append(batch)  # held until the end while the workers go on
    assert len(kept) == (n + 2) // 3
    assert all(intact(batch) for batch in kept)
    seen = sorted(int(i) for batch in kept for i in batch["i"])
    assert len(set(seen)) == len(seen)


def test_views_keep_a_batch_alive():
    """A view (a slice) of a batch tensor keeps its storage out of the pool."""
    n = 24
    with make(n) as feed:
        views = [(batch["x"][2:5], batch["i"][2:5].clone()) for batch in feed]
    assert all(bool((x == i.double()[:, None]).all()) for x, i in views)


def test_restarted_workers_do_not_free_the_old_workers_slots():
    """Without persistent workers each epoch has new worker processes, which hand out the
    same slot indexes: dropping epoch 0's batches during epoch 1 must not free the slots of
    epoch 1's batches that the loop keeps."""
    with make(10, persistent_workers=False) as feed:
        first = list(feed)
        assert all(intact(batch) for batch in first)
        second = []
        for k, batch in enumerate(feed):
            second.append(batch)
            if k == 2:
                first.clear()  # the old workers' slots are released from here on
        del batch
    assert len(second) == 10 and all(intact(batch) for batch in second)


def test_two_live_iterators_without_persistent_workers_keep_their_batches():
    """Two iterators alive at once start two worker 0s; each set of workers has its own
    board, so neither frees (and overwrites) the other's kept batches."""
    feed = make(40, num_workers=1, persistent_workers=False)
    try:
        a = iter(feed)
        kept = [next(a) for _ in range(10)]
        b = iter(feed)
        kept.append(next(b))
        kept.extend(a)
        del b
    finally:
        feed.close()
    assert len(kept) == 41 and all(intact(batch) for batch in kept)


class KeepsRecent(IterableDataset):
    """Batches itself and keeps its last six batches in the worker (mixup with earlier
    batches, a replay buffer): the pool must not reuse them once the main process lets go."""

    batch_size = 8

    def __iter__(self):
        from streamdata.batch.collate import collate

        recent = []
        for b in range(40):
            batch = collate([{"x": np.full(WIDTH, float(b))} for _ in range(8)])
            batch["recent_intact"] = torch.tensor(all(bool((x["x"] == j).all()) for j, x in recent))
            yield batch
            recent = [*recent, (b, batch)][-6:]


def test_batches_the_worker_itself_keeps_are_never_reused():
    with loader(KeepsRecent(), num_workers=1, pin_memory=False) as feed:
        checks = [bool(batch["recent_intact"]) for batch in feed]
    assert len(checks) == 40 and all(checks)


class ReportsPool(Stamped):
    """Stamped samples that also carry how many bytes the worker's pool keeps."""

    def __iter__(self):
        for sample in super().__iter__():
            pool = recycle.active_pool()
            sample["pool_bytes"] = pool.pooled_bytes if pool is not None else -1
            yield sample


def test_the_pool_shrinks_back_after_the_loop_held_many_batches():
    """The loop keeps 18 batches for a while, then lets go: the worker's pool had to grow
    to hold them, and drops the storages it no longer reuses (IDLE_REQUESTS). A batch here
    takes three slots ("x", "i" and "pool_bytes"), so 18 fit in a worker's 64."""
    n = 18 + 2 * recycle.IDLE_REQUESTS
    with loader(ReportsPool(8 * n), num_workers=1, pin_memory=False, batch_size=8) as feed:
        held, reports, mapped = [], [], []
        for k, batch in enumerate(feed):
            assert intact(batch)
            reports.append(int(batch["pool_bytes"].max()))
            mapped.append(len(feed.board.mapped))
            if k < 18:
                held.append(batch)
            elif k == 18:
                held.clear()
    batch_bytes = 8 * WIDTH * 8
    assert min(reports) >= 0
    assert max(reports) >= 15 * batch_bytes  # it grew: the held batches were out
    assert reports[-1] <= 8 * batch_bytes, reports[-20:]  # back to the few in flight
    # MAPPED-ONCE: the main process let go of the mappings of the storages the worker dropped
    assert max(mapped) >= 3 * 15 and mapped[-1] <= 3 * (8 + 2), mapped[-20:]


def test_a_ref_is_rebuilt_on_the_boards_mapping_forgotten_on_request_and_refused_elsewhere(pool):
    """MAPPED-ONCE, the main process's side: a ``_Ref`` becomes a view of the mapping the board
    keeps for its worker and slot (that generation only); a batch's ``forget`` drops a mapping;
    where the board is not known (a batch sent to another process) our error names the way out."""
    import streamdata as sd

    _, board, _, _ = pool
    storage = torch.UntypedStorage(64).share_memory_()
    torch.empty(0, dtype=torch.uint8).set_(storage, 0, (64,))[:] = torch.arange(64, dtype=torch.uint8)

    def received(board_id, gen=7, forget=()):
        ref = recycle._Ref.__new__(recycle._Ref)
        ref.__setstate__((0, gen, torch.uint8, (4, 8), (8, 1), 16))  # rows 2-5 of 8 bytes
        lent = recycle._Lent.__new__(recycle._Lent)
        lent.__setstate__(({"x": ref}, board_id, 0, [(0, 0, 99, gen)], list(forget)))
        return lent

    board.mapped[(0, 0)] = (7, storage)
    got = received(board.id).batch["x"]
    assert got.untyped_storage().data_ptr() == storage.data_ptr() and got.is_shared()
    assert got.tolist() == [list(range(r * 8, r * 8 + 8)) for r in range(2, 6)]
    with pytest.raises(sd.StreamDataError, match="recycle_buffers=False"):
        received(board.id, gen=8)  # another allocation of that slot: not this mapping
    del got
    recycle.reclaim()
    recycle._Lent.__new__(recycle._Lent).__setstate__(({}, board.id, 0, [], [(0, 7), (1, 3)]))
    assert board.mapped == {}  # slot 0's generation 7 forgotten (slot 1 held nothing)
    with pytest.raises(sd.StreamDataError, match="recycle_buffers=False"):
        received(board.id + 1)  # a board this process does not have


def test_batches_read_from_the_dataloader_directly_are_still_released():
    """Iterating ``loader.dataloader`` (no unwrap, so nobody calls ``reclaim``): the main
    process's list of lent storages stays bounded and the slots are still reused, long
    after every worker's pool would have run out of slots (3 x SLOTS_PER_WORKER batches)."""
    n = 3 * recycle.SLOTS_PER_WORKER
    with make(n, num_workers=1) as feed:
        sizes, inodes = [], []
        for item in feed.dataloader:
            assert item.tickets and intact(item.batch)  # lent, naming its slots
            inodes.append(storage_inode(item.batch["x"]))
            sizes.append(recycle.lent_count())
        del item
    assert len(inodes) == n
    assert max(sizes) <= 40, sizes
    # released in bursts (at each prune), so a few more storages than through unwrap; never
    # released, every batch after the 64th would take a new one
    assert len(set(inodes)) <= 24, f"{len(set(inodes))} distinct storages for {n} batches"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_lent_batch_does_not_free_its_slot(how):
    """A copy of a wrapped batch (its own private storage) dies early; the batch it was
    copied from is kept: the slot must stay out of the pool."""
    import copy

    n = 60
    with make(n, num_workers=1) as feed:
        kept = []
        for k, item in enumerate(feed.dataloader):
            twin = copy.deepcopy(item) if how == "deepcopy" else pickle.loads(pickle.dumps(item))
            assert intact(twin.batch)
            del twin
            if k < 20:
                kept.append(item.batch)
        del item
    assert len(kept) == 20 and all(intact(batch) for batch in kept)


def test_an_early_break_then_a_new_epoch_keeps_reusing():
    n = 20
    with make(n) as feed:
        for k, _batch in enumerate(feed):
            if k == 3:
                break
        del _batch
        inodes = [storage_inode(batch["x"]) for batch in feed if intact(batch)]
    assert len(inodes) == n  # every batch of the second epoch arrived intact
    assert len(set(inodes)) <= 14


def test_user_collate_fn_is_wrapped_and_a_plain_batch_passes_through():
    def plain(samples):
        return [s["i"] for s in samples]  # no tensors: nothing to lend

    with make(4, collate_fn=plain) as feed:
        batches = list(feed)
    assert sorted(i for b in batches for i in b) == list(range(32))


# --- the pool on its own (in this process, a board of one worker) ----------------------------

@pytest.fixture
def pool():
    board = recycle.Board(1, slots=3)
    made = []

    def allocate(nbytes):
        made.append(nbytes)
        return torch.UntypedStorage(nbytes)

    p = recycle.BufferPool(board, 0)
    yield p, board, allocate, made
    board.close()


def test_pool_reuses_only_free_slots_of_a_fitting_size(pool):
    p, board, allocate, made = pool
    a = p.storage(1000, allocate)
    assert board.states[0].count_nonzero() == 1  # lent
    b = p.storage(1000, allocate)
    assert a.data_ptr() != b.data_ptr() and made == [1000, 1000]
    token = int(board.states[0][0])
    assert board.release(0, 0, token) and not board.release(0, 0, token)
    assert p.storage(900, allocate).data_ptr() == a.data_ptr()  # free and big enough
    assert p.storage(300, allocate).data_ptr() not in (a.data_ptr(), b.data_ptr())  # too big to waste
    assert made == [1000, 1000, 300]
    assert p.stats == {"reused": 1, "allocated": 3, "unpooled": 0, "dropped": 0}


def test_pool_drops_free_storages_it_has_not_reused_for_a_while(monkeypatch):
    monkeypatch.setattr(recycle, "IDLE_REQUESTS", 4)
    board = recycle.Board(1, slots=8)
    p = recycle.BufferPool(board, 0)

    def release_last():
        slot = max(range(8), key=lambda i: p._slots[i].last_used if p._slots[i] else -1)
        assert board.release(0, slot, int(board.states[0][slot]))

    try:
        lent = p.storage(100, torch.UntypedStorage)  # out with a batch: never dropped
        # free on the board, still used here (a tensor on it, as a batch the worker keeps)
        kept = torch.empty(0, dtype=torch.uint8).set_(p.storage(200, torch.UntypedStorage), 0, (200,))
        release_last()
        p.storage(300, torch.UntypedStorage)  # free and unused: dropped once idle
        release_last()
        assert p.pooled_bytes == 600
        for _ in range(5):  # small batches now, each released at once: one slot serves them
            p.storage(20, torch.UntypedStorage)
            release_last()
        assert p.stats == {"reused": 4, "allocated": 4, "unpooled": 0, "dropped": 1}
        assert p.pooled_bytes == 100 + 200 + 20
        assert p._slots[0].storage.data_ptr() == lent.data_ptr()
        assert p._slots[1].storage.data_ptr() == kept.data_ptr()
    finally:
        board.close()


def test_pool_allocates_unpooled_storage_when_every_slot_is_out(pool):
    p, board, allocate, made = pool
    for _ in range(4):
        p.storage(10, allocate)
    assert p.stats == {"reused": 0, "allocated": 3, "unpooled": 1, "dropped": 0}
    assert board.states[0].count_nonzero() == 3


def test_lend_names_the_slots_in_the_batch_and_frees_storages_dropped_unsent(pool):
    p, board, allocate, _ = pool
    used = torch.empty(0, dtype=torch.uint8).set_(p.storage(64, allocate), 0, (64,))
    p.storage(64, allocate)  # handed out, then dropped without being sent
    batch = {"x": used, "label": "cat"}
    lent = p.lend(batch)
    assert lent is not batch and lent.batch is batch and next(recycle.unwrap([lent])) is batch
    assert [(pos, slot) for pos, slot, _, _ in lent.tickets] == [(0, 0)]
    assert int(board.states[0][1]) == recycle.FREE and int(board.states[0][0]) != recycle.FREE
    plain = {"y": torch.zeros(2)}
    assert p.lend(plain) is plain  # nothing pending: no wrapper


def test_unpickling_registers_and_reclaim_releases_when_the_storage_is_gone(pool):
    p, board, allocate, _ = pool
    recycle.reclaim()  # what earlier tests left
    before = recycle.lent_count()
    storage = p.storage(64, allocate)
    lent = p.lend(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (64,)))
    # as the main process unpickles it: a shared mapping of its own (here, a shared copy)
    lent_type = type(lent)  # unpickling: a bare instance, then __setstate__
    received = lent_type.__new__(lent_type)
    received.__setstate__((lent.batch.clone().share_memory_(), *lent.__getstate__()[1:]))
    received_again = lent_type.__new__(lent_type)  # the same batch unpickled twice
    received_again.__setstate__(received.__getstate__())
    assert recycle.lent_count() == before + 1
    del received_again
    batch = next(recycle.unwrap([received]))
    assert int(board.states[0][0]) != recycle.FREE
    assert recycle.reclaim() == 0  # still referenced here
    del batch, received
    assert recycle.reclaim() == 1
    assert int(board.states[0][0]) == recycle.FREE


@pytest.mark.cuda
def test_pinned_batches_release_their_shared_memory_at_once():
    """DataLoader(pin_memory=True): the pinning thread copies each batch out of shared
    memory, so every slot is free again right away; the pinned batches stay intact."""
    n = 30
    with make(n, pin_memory=True) as feed:
        kept = list(feed)
    assert len(kept) == n and all(batch["x"].is_pinned() and intact(batch) for batch in kept)


def test_a_process_forked_from_a_worker_has_no_pool(monkeypatch):
    """FORK-RESET ("pools"): the pool a worker installed is not inherited by its own children,
    and the worker keeps it."""

    board = recycle.Board(1)
    monkeypatch.setattr(recycle, "_POOL", None)
    recycle.install(board, 0)
    mine = recycle.active_pool()

    def child(conn):
        conn.send(recycle.active_pool() is None)

    try:
        got = in_forked_child(child)
        assert got is True and mine is not None and recycle.active_pool() is mine
    finally:
        board.close()


def test_a_reused_storage_crosses_to_the_main_process_by_descriptor_once(monkeypatch):
    """MAPPED-ONCE: the main process keeps each pooled storage's mapping, so a batch in a
    storage it has seen carries no descriptor (torch's hand-over is a round trip to the
    worker per storage and batch); kept batches stay intact all the same."""
    from multiprocessing import resource_sharer

    handed = []
    real = resource_sharer.DupFd.detach
    monkeypatch.setattr(resource_sharer.DupFd, "detach", lambda self: handed.append(1) or real(self))
    n = 60
    with make(n) as feed:
        kept, mapped = [], 0
        for k, batch in enumerate(feed):
            assert intact(batch)
            if k % 10 == 0:
                kept.append(batch)  # out of the pool while kept: never written again
            mapped = max(mapped, len(feed.board.mapped))
        assert all(intact(batch) for batch in kept)
    # "x" and "i" (a column made from ints) live in the pool: one descriptor per storage
    # allocated (``mapped``), none per batch; without MAPPED-ONCE every batch's two would: 2 * n
    assert 0 < mapped < n and len(handed) <= mapped, (len(handed), mapped)
