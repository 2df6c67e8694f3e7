"""The main process's share of a batch from ``sd.loader``'s workers (streamdata/batch/recycle.py):
a batch's array fields cross as one storage, and a batch in storages the main process has
mapped already is registered from its tickets alone (MAPPED-ONCE), with the same releases."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.utils.data import IterableDataset

from streamdata.batch import recycle
from streamdata.feed.loader import loader

FIELDS = 12


class ManyFields(IterableDataset):
    """Samples of ``FIELDS`` small arrays (field ``f`` of sample ``i``: ``i * 100 + f``, in a
    dtype of its own) and an int label, split between the workers."""

    dtypes = (np.float32, np.int64, np.uint8, np.float64)

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(start, self.n, step):
            yield {**{f"f{f}": np.full((f % 3 + 1,), (i * 100 + f) % 250, self.dtypes[f % 4])
                      for f in range(FIELDS)}, "i": i}


def intact(batch: dict) -> bool:
    return all(bool((batch[f"f{f}"].double() == ((batch["i"] * 100 + f) % 250).double()[:, None]).all())
               for f in range(FIELDS))


def test_array_fields_cross_in_one_storage_and_are_released_once_dropped():
    n = 60
    with loader(ManyFields(8 * n), batch_size=8, num_workers=2, pin_memory=False) as feed:
        kept, storages, out = [], set(), []
        for step, batch in enumerate(feed):
            assert intact(batch)
            ptrs = {batch[f"f{f}"].untyped_storage().data_ptr() for f in range(FIELDS)}
            assert len(ptrs) == 1, "a batch's array fields share one storage"
            offsets = [batch[f"f{f}"].storage_offset() * batch[f"f{f}"].element_size() for f in range(FIELDS)]
            assert all(o % 64 == 0 for o in offsets) and len(set(offsets)) == FIELDS
            storages |= ptrs
            out.append(recycle.lent_count())
            if step % 10 == 0:
                kept.append(batch)  # held by the loop: never written again
        del batch
        assert all(intact(b) for b in kept)
    assert len(kept) == n // 10
    # a few batches out at a time: one slot for the arrays and one for the label each, so the
    # pool reuses a handful of storages (never released, every batch would take a new one)
    assert max(out) <= 2 * (len(kept) + 8), out
    assert len(storages) <= len(kept) + 12, f"{len(storages)} storages for {n} batches"


def test_a_copy_of_a_batch_received_by_reference_keeps_the_slot_out():
    """Past the first batches every storage comes by reference (MAPPED-ONCE); a deep copy of
    the wrapped batch registers nothing, and the slot stays out while the batch is held."""
    n = 40
    with loader(ManyFields(8 * n), batch_size=8, num_workers=1, pin_memory=False) as feed:
        items = iter(feed.dataloader)
        first = [next(items) for _ in range(20)]  # later ones reuse freed slots: by reference
        del first
        recycle.reclaim()
        held = next(items)
        assert intact(held.batch)
        before = recycle.lent_count()
        twin = copy.deepcopy(held)
        assert intact(twin.batch) and recycle.lent_count() == before
        del twin
        recycle.reclaim()
        assert recycle.lent_count() == before  # the batch itself is still held: its slots stay out
        storage = held.batch["f0"].untyped_storage()
        assert all(held.batch[f"f{f}"].untyped_storage().data_ptr() == storage.data_ptr()
                   for f in range(FIELDS))
        for rest in items:
            assert intact(rest.batch)
        assert intact(held.batch)
