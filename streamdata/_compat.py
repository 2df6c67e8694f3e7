"""Every third-party private API streamdata relies on, each behind one named function.

A private attribute can change in any release of the library that owns it. Each function here
names the version it was checked against, and ``tests/test_compat.py`` has a test per function
that fails when the private it wraps is gone or behaves otherwise: an upgrade that breaks one
shows up there, by name, not as a hang or a leak somewhere downstream. Callers import the
function, never the private name. Heavy libraries are imported inside the functions, so this
module costs nothing at ``import streamdata``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import asyncio
    import concurrent.futures

    import torch
    from torch.utils.data import DataLoader

__all__ = ["dataloader_iterator", "default_executor", "detach_dataloader_iterator", "executor_threads",
           "new_shared_storage", "shutdown_workers", "storage_use_count", "worker_processes"]


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
