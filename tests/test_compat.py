"""``streamdata._compat``: each wrapped private still exists and behaves as streamdata uses it,
against the pinned versions.

One test per function; a failure here names the private an upgrade of torch, Python or aiohttp
changed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import struct
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from streamdata import _compat
from streamdata._compat import (
    aiohttp_forget,
    aiohttp_no_hidden_retry,
    aiohttp_payload_reset,
    aiohttp_session_of,
)
from tests.store.test_h1 import Script, answer_once_then_close, ok, script  # noqa: F401  (the fixture)

# --- torch and the standard library ---


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


class _Asks(IterableDataset):
    def __iter__(self):
        return iter(())

    def __len__(self):
        asking = _compat.dataloader_asking(sys._getframe(1))
        return -1 if asking is None else asking.num_workers


def test_torch_dataloader_asking_is_the_loader_whose_len_asks():
    assert len(DataLoader(_Asks(), batch_size=None, num_workers=3)) == 3
    assert _Asks().__len__() == -1  # nobody's DataLoader.__len__


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
def test_every_wrapper_names_its_private_and_version(name):
    doc = getattr(_compat, name).__doc__ or ""
    if name != "aiohttp_payload_reset":  # the one private detail that is a message's text
        assert "._" in doc, f"{name}: say which private it wraps"
    versions = ("torch 2.", "CPython 3.", "aiohttp 3.", "fsspec 20", "accelerate 1.", "lightning 2.",
                "ray 2.")
    assert any(v in doc for v in versions), f"{name}: say which version it was checked against"


# --- aiohttp ---


def test_aiohttp_no_hidden_retry_stops_the_silent_resend(script) -> None:  # noqa: F811
    import aiohttp

    server = script(answer_once_then_close)

    async def go():
        async with aiohttp.ClientSession() as session:
            assert session._retry_connection is True  # the private aiohttp re-sends by
            aiohttp_no_hidden_retry(session)
            async with session.get(server.url()) as resp:
                assert await resp.read() == b"first"
            with pytest.raises(aiohttp.ServerDisconnectedError):
                async with session.get(server.url()) as resp:
                    await resp.read()

    asyncio.run(go())
    assert len(server.requests) == 2 and server.connections == 1  # sent once, never re-sent


def test_aiohttp_forget_leaves_the_connections_open(script) -> None:  # noqa: F811
    import aiohttp

    server = script(lambda c, i, head: c.sendall(ok(b"v")) or True)

    async def go():
        session = aiohttp.ClientSession()
        async with session.get(server.url()) as resp:
            await resp.read()  # its connection now idle in the pool
        aiohttp_forget(session)
        assert session.connector is None
        await session.close()  # as a finaliser would: it must not close the inherited socket

    asyncio.run(go())
    time.sleep(0.2)
    assert server.connections == 1 and server.threads[1].is_alive()  # the server never saw EOF


@pytest.mark.parametrize("reset", [True, False])
def test_aiohttp_payload_reset_tells_a_reset_from_a_clean_cut(script, reset: bool) -> None:  # noqa: F811
    import aiohttp

    def answer(c, i, head):
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"z" * 1000)
        if reset:
            time.sleep(0.3)  # the client has read the bytes sent and waits for more
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
        return False

    server = script(answer)

    async def go():
        async with aiohttp.ClientSession() as session, session.get(server.url()) as resp:
            async for _ in resp.content.iter_chunks():
                pass

    with pytest.raises(aiohttp.ClientPayloadError) as info:
        asyncio.run(go())
    assert aiohttp_payload_reset(info.value) is reset


def test_aiohttp_session_of_finds_fsspec_http_session() -> None:
    from fsspec.implementations.http import HTTPFileSystem

    async def go():
        fs = HTTPFileSystem(asynchronous=True, skip_instance_cache=True)
        assert aiohttp_session_of(fs) is None  # not made yet
        session = await fs.set_session()
        assert aiohttp_session_of(fs) is session
        await session.close()

    asyncio.run(go())
    assert aiohttp_session_of(object()) is None


# --- accelerate ---


def test_prepared_by_accelerate_names_the_wrapper_that_sets_the_epoch():
    """accelerate's prepared loaders call ``dataset.set_epoch`` from accelerate.data_loader."""
    import sys

    data_loader = pytest.importorskip("accelerate.data_loader")
    seen = []

    class Recorder(IterableDataset):
        def set_epoch(self, epoch):
            seen.append(_compat.prepared_by_accelerate(sys._getframe(1)))

        def __iter__(self):
            return iter(())

    data_loader.IterableDatasetShard(Recorder(), batch_size=2, num_processes=2, process_index=0).set_epoch(1)
    data_loader.DataLoaderShard(Recorder(), batch_size=None).set_epoch(1)
    Recorder().set_epoch(1)
    assert seen == ["IterableDatasetShard", "DataLoaderShard", None]


# --- Lightning, Ray Train ---


class _AskedBy:
    """An iterable whose iterators note, at their first ``next()``, what the frames above it
    answer (the first frame a function knows)."""

    def __init__(self, ahead, n: int = 4, sized: bool = False) -> None:
        self.ahead, self.n, self.sized, self.seen = ahead, n, sized, []

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no len()")
        return self.n

    def __iter__(self):
        import sys

        frame = sys._getframe(1)  # the caller of the first next()
        found = None
        while frame is not None and found is None:
            found, frame = self.ahead(frame), frame.f_back
        self.seen.append(found)
        yield from range(self.n)


@pytest.mark.parametrize("sized,ahead", [(False, 1), (True, 0)])
def test_ahead_by_lightning_reads_the_prefetching_fetcher(sized, ahead):
    """``_PrefetchDataFetcher`` takes one ahead of the step only when the loaders have no len()."""
    fetchers = pytest.importorskip("lightning.pytorch.loops.fetchers")
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    source = _AskedBy(_compat.ahead_by_lightning, sized=sized)
    fetcher = fetchers._PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(source, "max_size_cycle"))
    assert len(list(fetcher)) == 4
    assert source.seen == [ahead]
    plain = _AskedBy(_compat.ahead_by_lightning)
    assert list(plain) == [0, 1, 2, 3] and plain.seen == [None]  # no fetcher: None


def test_ahead_by_lightning_a_step_taking_dataloader_iter_holds_none():
    fetchers = pytest.importorskip("lightning.pytorch.loops.fetchers")
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    source = _AskedBy(_compat.ahead_by_lightning)
    fetcher = fetchers._DataLoaderIterDataFetcher()
    fetcher.setup(CombinedLoader(source, "max_size_cycle"))
    dataloader_iter = next(iter(fetcher))
    next(dataloader_iter)  # the step asks for its batch itself
    assert source.seen == [0]


def test_ahead_by_ray_train_reads_the_device_wrapper():
    """``prepare_data_loader(..., move_to_device=True)``'s wrapper takes the next batch as it
    hands one out."""
    utils = pytest.importorskip("ray.train.torch.train_loop_utils")

    source = _AskedBy(_compat.ahead_by_ray_train)
    wrapped = utils._WrappedDataLoader(source, torch.device("cpu"), False)
    assert list(wrapped) == [0, 1, 2, 3]
    assert source.seen == [1]
