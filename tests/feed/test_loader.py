"""The sd.loader preset: defaults, overrides, len / set_epoch / close, sharing strategy."""

from __future__ import annotations

import functools
import importlib
import os
import types

import numpy as np
import pytest
import torch
import torch.multiprocessing
from torch.utils.data import IterableDataset

import streamdata
from streamdata.batch import collate as C
from streamdata.errors import SpecError
from streamdata.feed import cuda as K
from streamdata.feed.cuda import CudaPrefetcher
from streamdata.feed.loader import (
    DEFAULT_PREFETCH_FACTOR,
    Loader,
    default_num_workers,
    loader,
)


class Numbers(IterableDataset):
    """Per-sample items; no len."""

    def __init__(self, n: int = 6):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield {"x": np.full(3, float(i)), "i": i}


class Sized(Numbers):
    """Per-sample items with a len."""

    def __len__(self) -> int:
        return self.n


class SelfBatched(IterableDataset):
    """A dataset that batches itself, as the streamdata datasets do with batch_size=..."""

    batch_size = 4

    def __iter__(self):
        for b in range(3):
            yield {"x": np.arange(8.0).reshape(4, 2) + b, "keys": [f"k{b}{j}" for j in range(4)]}


class EpochTagged(IterableDataset):
    """Keeps its epoch in a shared-memory tensor, so persistent workers see set_epoch."""

    def __init__(self):
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self):
        for i in range(3):
            yield {"value": int(self.epoch) * 100 + i, "pid": os.getpid()}


class ReportStrategy(IterableDataset):
    def __iter__(self):
        yield torch.multiprocessing.get_sharing_strategy()


def test_defaults_with_workers():
    with loader(Numbers(), num_workers=2, batch_size=2) as feed:
        dl = feed.dataloader
        assert dl.num_workers == 2 and dl.persistent_workers
        assert dl.prefetch_factor == DEFAULT_PREFETCH_FACTOR
        assert dl.pin_memory == torch.cuda.is_available()
        assert feed.board is not None  # buffers recycled (what that does: test_recycle.py)
        # a per-sample IterableDataset is batched in the workers, sample by sample: the
        # DataLoader gets a wrapper of the user's dataset that yields whole batches
        assert dl.batch_size is None and dl.dataset is not feed.dataset
        assert (dl.dataset.batch_size, dl.dataset.in_flight) == (2, 2 * DEFAULT_PREFETCH_FACTOR)
        assert feed.prefetcher is None and feed.dataset is dl.dataset.dataset
        assert [b["i"].tolist() for b in feed] == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5]]
    with loader(list(range(6)), num_workers=2, batch_size=2) as feed:  # map-style: DataLoader batches
        collate_fn = feed.dataloader.collate_fn.collate_fn
        assert isinstance(collate_fn, functools.partial) and collate_fn.func is C.collate
        assert collate_fn.keywords == {"in_flight": 2 * DEFAULT_PREFETCH_FACTOR}
        assert feed.dataloader.batch_size == 2 and len(feed) == 3


def test_batching_in_the_workers_keeps_drop_last_and_len():
    feed = loader(Sized(7), num_workers=1, batch_size=3, drop_last=True)
    assert len(feed) == 2 and [b["i"].tolist() for b in feed] == [[0, 1, 2], [3, 4, 5]]
    feed.close()
    feed = loader(Sized(7), num_workers=1, batch_size=3)
    assert len(feed) == 3 and [len(b["i"]) for b in feed] == [3, 3, 1]
    feed.close()
    with pytest.raises(TypeError):
        len(loader(Numbers(), num_workers=1, batch_size=3))


class Range(IterableDataset):
    """The pattern of torch's IterableDataset docs: worker_init_fn splits start/end."""

    def __init__(self, n: int) -> None:
        self.start, self.end = 0, n

    def __iter__(self):
        return iter(range(self.start, self.end))


def _split_range(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    ds = info.dataset  # sd.loader's wrapper: reads and writes reach the user's dataset
    per = (ds.end - ds.start) // info.num_workers
    ds.start, ds.end = ds.start + worker_id * per, ds.start + (worker_id + 1) * per


@pytest.mark.parametrize("context", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_worker_init_fn_can_split_the_users_dataset_through_worker_info(context):
    with loader(Range(16), batch_size=4, num_workers=2, worker_init_fn=_split_range,
                pin_memory=False, multiprocessing_context=context) as feed:
        assert sorted(int(x) for batch in feed for x in batch) == list(range(16))


def test_defaults_without_workers_and_the_default_worker_count():
    feed = loader(Numbers(), num_workers=0)
    dl = feed.dataloader
    assert dl.prefetch_factor is None and not dl.persistent_workers and dl.batch_size == 1
    assert default_num_workers() == min(4, len(os.sched_getaffinity(0)))
    assert loader(Numbers()).dataloader.num_workers == default_num_workers()


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (3, 3), (4, 4), (64, 4)])
def test_the_default_worker_count_follows_the_usable_cores(monkeypatch, cpus, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert default_num_workers() == expected
    with loader(Numbers(), pin_memory=False) as feed:
        assert feed.dataloader.num_workers == expected


def test_the_default_worker_count_without_sched_getaffinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")  # not on Linux: the CPU count
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert default_num_workers() == 2
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert default_num_workers() == 1


def test_everything_is_overridable():
    def mine(batch):
        return batch

    feed = loader(Numbers(), num_workers=1, prefetch_factor=6, persistent_workers=False,
                  pin_memory=False, collate_fn=mine, batch_size=3, drop_last=True,
                  recycle_buffers=False)
    dl = feed.dataloader
    assert (dl.prefetch_factor, dl.persistent_workers, dl.pin_memory) == (6, False, False)
    assert dl.collate_fn is mine and dl.batch_size == 3 and dl.drop_last and feed.board is None
    assert loader(Numbers(), num_workers=1, collate_fn=mine).dataloader.collate_fn.collate_fn is mine


def test_a_dataset_that_batches_itself_gets_batch_size_none_and_tensors():
    feed = loader(SelfBatched(), num_workers=0)
    assert feed.dataloader.batch_size is None
    batches = list(feed)
    assert len(batches) == 3
    assert batches[1]["x"].dtype == torch.float64 and torch.equal(
        batches[1]["x"], torch.arange(8.0).reshape(4, 2) + 1)
    assert batches[2]["keys"] == ["k20", "k21", "k22", "k23"]


def test_per_sample_items_are_collated_into_batches():
    batches = list(loader(Numbers(5), num_workers=0, batch_size=2))
    assert [b["i"].tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert batches[0]["x"].shape == (2, 3)


def test_len_passes_through_when_the_dataloader_has_one():
    assert len(loader(list(range(10)), batch_size=3, num_workers=0)) == 4
    with pytest.raises(TypeError):
        len(loader(Numbers(), num_workers=0))


def test_set_epoch_passes_through_or_says_the_dataset_has_none():
    dataset = EpochTagged()
    feed = loader(dataset, num_workers=0)
    feed.set_epoch(3)
    assert int(dataset.epoch) == 3
    with pytest.raises(AttributeError, match="Numbers has no set_epoch"):
        loader(Numbers(), num_workers=0).set_epoch(1)


def test_persistent_workers_see_set_epoch_and_close_ends_them():
    with loader(EpochTagged(), num_workers=1, batch_size=None, multiprocessing_context="fork") as feed:
        epochs = []
        for epoch in range(2):
            feed.set_epoch(epoch)
            epochs.append(list(feed))
        assert [[b["value"] for b in e] for e in epochs] == [[0, 1, 2], [100, 101, 102]]
        pids = {b["pid"] for e in epochs for b in e}
        assert len(pids) == 1 and pids != {os.getpid()}  # the same worker served both epochs
    assert feed.dataloader._iterator is None  # close() shut the workers down


def test_close_in_the_middle_of_an_epoch_ends_the_workers():
    feed = loader(Numbers(10_000), num_workers=2, batch_size=8, multiprocessing_context="fork")
    batches = iter(feed)
    assert next(batches)["x"].shape == (8, 3)
    workers = list(feed.dataloader._iterator._workers)
    feed.close()
    assert feed.dataloader._iterator is None
    assert not any(w.is_alive() for w in workers)


def test_real_workers_deliver_self_batched_numpy_as_tensors():
    with loader(SelfBatched(), num_workers=1, multiprocessing_context="fork") as feed:
        batches = list(feed)
    assert [b["x"][0, 0].item() for b in batches] == [0.0, 1.0, 2.0]
    assert all(isinstance(b["x"], torch.Tensor) for b in batches)


def test_device_wraps_the_loader_in_the_prefetcher(monkeypatch):
    monkeypatch.setattr(K, "_cuda_available", lambda: False)
    feed = loader(Numbers(4), num_workers=0, batch_size=2, device="cpu",
                  transform=lambda b: {**b, "x": b["x"] * 10})
    assert isinstance(feed.prefetcher, CudaPrefetcher) and feed.prefetcher.device.type == "cpu"
    assert [b["x"][:, 0].tolist() for b in feed] == [[0.0, 10.0], [20.0, 30.0]]
    feed.close()


@pytest.mark.parametrize("pin_memory, workers, thread", [(True, 2, False), (False, 2, True),
                                                         (True, 0, True), (False, 0, True)])
def test_the_prefetcher_has_a_thread_of_its_own_unless_the_dataloaders_pin_thread_does_its_work(
        pin_memory, workers, thread):
    feed = loader(Numbers(4), num_workers=workers, batch_size=2, device="cuda", pin_memory=pin_memory)
    assert feed.prefetcher.thread is thread
    feed.close()


def test_sharing_strategy_is_set_here_and_in_every_worker(restore_sharing_strategy):
    with loader(ReportStrategy(), num_workers=1, batch_size=None, sharing_strategy="file_system",
                multiprocessing_context="fork") as feed:
        assert torch.multiprocessing.get_sharing_strategy() == "file_system"
        # a worker that does not inherit it (spawn, or a later change here) still gets it
        torch.multiprocessing.set_sharing_strategy("file_descriptor")
        assert list(feed) == ["file_system"]


_INITS_SEEN: list[int] = []  # in a worker: the ids the user's worker_init_fn was called with


def _record_init(worker_id: int) -> None:
    _INITS_SEEN.append(worker_id)


class ReportInit(IterableDataset):
    def __iter__(self):
        yield f"{_INITS_SEEN} {torch.multiprocessing.get_sharing_strategy()}"


def test_worker_init_keeps_the_users_function(restore_sharing_strategy):
    with loader(ReportInit(), num_workers=1, batch_size=None, sharing_strategy="file_system",
                worker_init_fn=_record_init, multiprocessing_context="fork") as feed:
        torch.multiprocessing.set_sharing_strategy("file_descriptor")  # ours still runs in the worker
        assert list(feed) == ["[0] file_system"]


def test_an_unknown_sharing_strategy_is_refused():
    with pytest.raises(SpecError, match="unknown sharing_strategy"):
        loader(Numbers(), sharing_strategy="carrier_pigeon")


def test_a_loader_without_workers_yields_the_batches_in_this_process_every_epoch():
    feed = loader(Numbers(4), num_workers=0, batch_size=2)
    assert isinstance(feed, Loader) and feed.dataloader.num_workers == 0
    for _ in range(2):
        got = list(feed)
        assert [b["i"].tolist() for b in got] == [[0, 1], [2, 3]]
        assert [b["x"].tolist() for b in got] == [[[0.0] * 3, [1.0] * 3], [[2.0] * 3, [3.0] * 3]]
        assert not any(b["x"].is_shared() for b in got)  # no worker: no shared memory


def test_the_preset_module_and_the_loader_function_have_different_names():
    module = importlib.import_module("streamdata.feed.loader")
    assert isinstance(module, types.ModuleType) and module.loader is loader
    assert streamdata.loader is loader and callable(streamdata.loader)
    assert streamdata.Loader is Loader
