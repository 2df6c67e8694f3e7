"""Every third-party private API streamdata relies on, each behind one named function.

A private attribute can change in any release of the library that owns it. Each function here
names the version it was checked against, and ``tests/test_compat.py`` has a test per function
that fails when the private it wraps is gone or behaves otherwise: an upgrade that breaks one
shows up there, by name, not as a hang or a leak somewhere downstream. Callers import the
function, never the private name. Heavy libraries are imported inside the functions, so this
module costs nothing at ``import streamdata``. Sections: torch, the standard library, aiohttp,
accelerate, Lightning and Ray Train.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures

    import torch
    from torch.utils.data import DataLoader

__all__ = ["ahead_by_lightning", "ahead_by_ray_train", "aiohttp_forget", "aiohttp_no_hidden_retry",
           "aiohttp_payload_reset", "aiohttp_session_of", "dataloader_asking", "dataloader_iterator",
           "default_executor", "detach_dataloader_iterator", "executor_threads", "new_shared_storage",
           "prepared_by_accelerate", "shutdown_workers", "storage_use_count", "worker_processes"]


# --- torch ---
# Checked against torch 2.13.0 (the version in the development environment; pyproject: torch>=2.1).


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many references hold ``storage``'s underlying C++ storage (tensors, storages, the
    shared-memory mapping): 1 when only ``storage`` itself does.

    ``torch._C._storage_Use_Count(storage._cdata)`` (torch 2.13.0)."""
    import torch

    return int(torch._C._storage_Use_Count(storage._cdata))


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A new storage of ``nbytes`` allocated in shared memory (``/dev/shm``), without first
    allocating it in private memory and copying. Raises RuntimeError when the filesystem is full.

    ``torch.UntypedStorage._new_shared(nbytes)`` (torch 2.13.0)."""
    import torch

    return torch.UntypedStorage._new_shared(nbytes)


def dataloader_asking(caller: Any) -> DataLoader | None:
    """The ``DataLoader`` whose ``__len__`` the frame ``caller`` (the caller's ``sys._getframe(1)``)
    runs, or None: for an IterableDataset, ``DataLoader.__len__`` calls ``len(self.dataset)`` itself
    and keeps it in ``DataLoader._IterableDataset_len_called`` (torch 2.13.0); a dataset that
    batches in its readers counts by the loader's ``num_workers``."""
    if caller is None or caller.f_code.co_name != "__len__":
        return None
    owner = caller.f_locals.get("self")
    from torch.utils.data import DataLoader

    return owner if isinstance(owner, DataLoader) else None


def dataloader_iterator(loader: DataLoader) -> Any | None:
    """The iterator a DataLoader keeps between epochs (its persistent workers), or None when it
    keeps none (no persistent workers, or none started yet).

    ``DataLoader._iterator`` (torch 2.13.0)."""
    return getattr(loader, "_iterator", None)


def detach_dataloader_iterator(loader: DataLoader) -> Any | None:
    """Take the kept iterator (``dataloader_iterator``) off the DataLoader, which then starts new
    workers at its next ``iter()``; the iterator, or None.

    ``DataLoader._iterator`` (torch 2.13.0)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        loader._iterator = None
    return iterator


def shutdown_workers(iterator: Any) -> None:
    """Stop a multi-process DataLoader iterator's workers and threads now (what its ``__del__``
    does); nothing for a single-process iterator.

    ``_MultiProcessingDataLoaderIter._shutdown_workers()`` (torch 2.13.0)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def worker_processes(iterator: Any) -> list[Any]:
    """A DataLoader iterator's worker processes (``multiprocessing.Process``); [] for a
    single-process iterator.

    ``_MultiProcessingDataLoaderIter._workers`` (torch 2.13.0)."""
    return list(getattr(iterator, "_workers", ()))


# --- stdlib ---
# Checked against CPython 3.11.7 (pyproject: requires-python >= 3.11).


def executor_threads(executor: concurrent.futures.Executor | None) -> list[threading.Thread]:
    """The threads a thread pool has started (to join them after ``shutdown``); [] for None or
    an executor without threads.

    ``ThreadPoolExecutor._threads`` (a set of ``threading.Thread``; CPython 3.11.7)."""
    return list(getattr(executor, "_threads", ()))


def default_executor(loop: asyncio.AbstractEventLoop) -> concurrent.futures.Executor | None:
    """The executor ``loop.run_in_executor(None, ...)`` has made, or None before the first such call.

    ``BaseEventLoop._default_executor`` (CPython 3.11.7)."""
    return getattr(loop, "_default_executor", None)


# --- aiohttp ---


def aiohttp_no_hidden_retry(session: Any) -> None:
    """Stop an aiohttp ``ClientSession`` from re-sending a GET, at once and unseen, when a
    reused connection drops before the answer: retries are ours (by deadline, throttled,
    counted). aiohttp has no public switch: its private ``ClientSession._retry_connection``
    flag (aiohttp 3.14.5)."""
    session._retry_connection = False


def aiohttp_forget(session: Any) -> None:
    """Drop an aiohttp ``ClientSession`` inherited through fork without touching its
    connections: finalising it in the child would close the parent's keep-alive sockets under
    the parent (seen: the parent's next request hung until its time-out). Detaches the
    private ``_connector``, marked closed (``_closed``) with its idle connections (``_conns``)
    forgotten, so neither the session's nor the connector's finaliser closes a socket
    (``ClientSession._connector``, ``BaseConnector._closed`` / ``._conns``: aiohttp 3.14.5)."""
    connector = session._connector
    if connector is not None:
        session._connector = None
        connector._closed = True
        connector._conns.clear()


def aiohttp_payload_reset(exc: BaseException) -> bool:
    """Whether an aiohttp ``ClientPayloadError`` (a body that ended early) ended because the
    connection was reset, not closed cleanly. aiohttp keeps the connection's error only in
    the message it builds (``"Response payload is not completed: <ContentLengthError ...>.
    ConnectionResetError(104, ...)"``); its ``__cause__`` is the parser's error either way.
    No private attribute: the message's text is the private detail (aiohttp 3.14.5)."""
    text = str(exc)
    return any(name in text for name in ("ConnectionResetError", "ConnectionAbortedError",
                                          "BrokenPipeError"))


def aiohttp_session_of(fs: Any) -> Any:
    """The aiohttp ``ClientSession`` an fsspec filesystem keeps (HTTP's and gcsfs's private
    ``HTTPFileSystem._session``, made by ``set_session``), or ``None`` (not made yet, or another
    backend). Checked against fsspec 2026.9.0 and gcsfs 2026.10.1."""
    import sys

    aiohttp = sys.modules.get("aiohttp")  # a session exists only once aiohttp is imported
    session = getattr(fs, "_session", None)
    return session if aiohttp is not None and isinstance(session, aiohttp.ClientSession) else None


# --- accelerate ---
# Checked against accelerate 1.15.0 (the test extra; streamdata does not import it).


def prepared_by_accelerate(caller: Any) -> str | None:
    """The class name of the accelerate loader whose method the frame ``caller`` (the caller's
    ``sys._getframe(1)``, CPython 3.11) runs, or None.

    A DataLoader that ``accelerator.prepare()`` wrapped calls its dataset's ``set_epoch`` as each
    iteration starts, from ``accelerate.data_loader``: ``DataLoaderShard.set_epoch`` (through
    ``IterableDatasetShard.set_epoch`` with more than one process) or
    ``DataLoaderDispatcher.set_epoch`` (accelerate 1.15.0)."""
    if caller is None or caller.f_globals.get("__name__") != "accelerate.data_loader":
        return None
    owner = caller.f_locals.get("self")
    return type(owner).__name__ if owner is not None else "accelerate.data_loader"


# --- Lightning, Ray Train ---
# Checked against lightning 2.6.6 and ray 2.60.0 (the test extra; streamdata imports neither).

_LIGHTNING_FETCHERS = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")


def ahead_by_lightning(frame: Any) -> int | None:
    """The batches a Lightning data fetcher whose method the frame runs takes ahead of the step
    it feeds, or None when the frame runs none.

    Lightning's loops iterate their loaders through a ``_DataFetcher`` (in
    ``lightning.pytorch.loops.fetchers``, or ``pytorch_lightning``'s).
    ``fetchers._PrefetchDataFetcher`` takes ``prefetch_batches`` (1) ahead, to know the last
    batch, only when its ``length`` is None (the loaders have no ``len()``; set as its iteration
    starts, before its first ``next()``); ``_DataLoaderIterDataFetcher`` (a step taking
    ``dataloader_iter``) takes none (lightning 2.6.6)."""
    if frame is None or frame.f_globals.get("__name__") not in _LIGHTNING_FETCHERS:
        return None
    fetcher = frame.f_locals.get("self")
    names = {c.__name__ for c in type(fetcher).__mro__}
    if "_DataFetcher" not in names:
        return None
    if "_PrefetchDataFetcher" not in names or getattr(fetcher, "length", None) is not None:
        return 0
    return int(getattr(fetcher, "prefetch_batches", 1))


def ahead_by_ray_train(frame: Any) -> int | None:
    """1 when the frame runs a method of Ray Train's ``_WrappedDataLoader`` (what
    ``prepare_data_loader(..., move_to_device=True)`` returns), else None.

    ``ray.train.torch.train_loop_utils._WrappedDataLoader`` takes the next batch of the loader it
    holds as it hands one out: in ``__iter__`` and each ``__next__``, through
    ``_prefetch_next_batch`` (Ray Train v2's ``prepare_data_loader`` uses the same class)
    (ray 2.60.0)."""
    if frame is None or frame.f_globals.get("__name__") != "ray.train.torch.train_loop_utils":
        return None
    names = {c.__name__ for c in type(frame.f_locals.get("self")).__mro__}
    return 1 if "_WrappedDataLoader" in names else None
