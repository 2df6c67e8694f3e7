"""``streamdata._compat``: each wrapped private still exists and behaves as streamdata uses it.

One test per function; a failure here names the private an upgrade of torch or Python changed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from streamdata import _compat


def test_torch_storage_use_count_counts_the_references_to_a_storage():
    storage = torch.UntypedStorage(64)
    assert _compat.storage_use_count(storage) == 1
    view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (64,))
    assert _compat.storage_use_count(storage) == 2  # the tensor holds it too
    del view
    assert _compat.storage_use_count(storage) == 1


def test_torch_new_shared_storage_is_in_shared_memory():
    storage = _compat.new_shared_storage(4096)
    assert isinstance(storage, torch.UntypedStorage)
    assert storage.nbytes() == 4096 and storage.is_shared()
    assert _compat.storage_use_count(storage) == 1


class _Count(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_torch_dataloader_iterator_is_kept_then_detached():
    loader = DataLoader(_Count(), batch_size=None, num_workers=1, persistent_workers=True)
    assert _compat.dataloader_iterator(loader) is None  # none before the first epoch
    assert list(loader) == [0, 1, 2, 3]
    kept = _compat.dataloader_iterator(loader)
    assert kept is not None
    assert _compat.detach_dataloader_iterator(loader) is kept
    assert _compat.dataloader_iterator(loader) is None and _compat.detach_dataloader_iterator(loader) is None
    _compat.shutdown_workers(kept)


def test_torch_shutdown_workers_stops_the_worker_processes():
    loader = DataLoader(_Count(), batch_size=None, num_workers=2, persistent_workers=True)
    assert list(loader) == [0, 0, 1, 1, 2, 2, 3, 3]
    iterator = _compat.detach_dataloader_iterator(loader)
    workers = _compat.worker_processes(iterator)
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    _compat.shutdown_workers(iterator)
    for worker in workers:
        worker.join(timeout=10)
    assert not any(w.is_alive() for w in workers)


def test_torch_single_process_iterators_have_no_workers():
    iterator = iter(DataLoader(_Count(), batch_size=None, num_workers=0))
    assert _compat.worker_processes(iterator) == []
    _compat.shutdown_workers(iterator)  # nothing to stop: no error
    assert next(iterator) == 0


def test_stdlib_executor_threads_are_the_pools_threads():
    assert _compat.executor_threads(None) == []
    pool = concurrent.futures.ThreadPoolExecutor(2)
    names = {pool.submit(lambda: threading.current_thread().name).result(timeout=10) for _ in range(8)}
    threads = _compat.executor_threads(pool)
    assert threads and all(isinstance(t, threading.Thread) for t in threads)
    assert names <= {t.name for t in threads}
    pool.shutdown(wait=True)
    assert not any(t.is_alive() for t in threads)


def test_stdlib_default_executor_is_made_by_run_in_executor():
    loop = asyncio.new_event_loop()
    try:
        assert _compat.default_executor(loop) is None
        name = loop.run_until_complete(loop.run_in_executor(None, lambda: threading.current_thread().name))
        executor = _compat.default_executor(loop)
        assert isinstance(executor, concurrent.futures.ThreadPoolExecutor)
        assert name in {t.name for t in _compat.executor_threads(executor)}
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


@pytest.mark.parametrize("name", _compat.__all__)
def test_stdlib_and_torch_wrappers_name_their_private_and_version(name):
    doc = getattr(_compat, name).__doc__ or ""
    assert "._" in doc, f"{name}: say which private it wraps"
    assert "torch 2." in doc or "CPython 3." in doc, f"{name}: say which version it was checked against"
