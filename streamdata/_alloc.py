"""Worker processes keep the memory they free, for the next epoch (glibc's malloc).

WORKER-MEMORY: a worker receives every byte of its shards into memory, parses it and frees
it. With glibc's defaults, blocks of more than 128 KiB (up to a threshold that adapts, at
most 32 MiB) are mapped and unmapped one by one, and free memory at the top of a heap
beyond twice that threshold goes back to the OS. Memory the fetcher frees is thus given
back and page-faulted in again: each new 4 KiB page costs a fault and its zeroing.
What the settings below save: benchmarks/README.md, "Epochs after the first".

:func:`keep_freed_memory`, called in each worker by :func:`streamdata.loader`, serves
blocks of up to 32 MiB from the heap and keeps up to 256 MiB of free memory there. A
worker's resident memory then stays near its peak (bounded by the fetcher's byte budget
plus the batches in flight) between epochs, instead of shrinking and growing back.
``sd.loader(..., reuse_worker_memory=False)`` keeps glibc's defaults.

INHERITED-HEAP: a forked DataLoader worker inherits its parent's garbage-collector counts
with its heap. After ``import torch`` (some 170,000 tracked objects) a full collection is
usually due, so the worker's first few hundred allocations, in torch's worker loop before any
code of ours or the user's ``worker_init_fn`` runs, start a full collection over everything
it inherited: 0.1-0.25 s per worker on a 2-core machine, on the way to the first batch, and
a write to every object's header, which copies the parent's heap into the worker page by
page. Right after the fork, in the child (``_fork``'s first stage), :func:`freeze_inherited`
moves every inherited object to the collector's permanent generation (``gc.freeze``: O(1), a
list splice); the collector is switched off from just before the fork until then (other
modules' after-fork hooks run first and allocate), and back on in both processes after. The
child's collections then walk only what it allocates itself. What it costs: inherited objects
still die by reference counting, but a reference cycle that includes an inherited object is
never collected in the child, also when the child's own objects are in it (their memory stays
until the child ends); ``gc.get_objects()`` in the child lists only its own. It acts only on
a fork that starts a torch DataLoader worker (``_fork.starting_dataloader_worker``), once the
fork hooks are installed (a dataset or loader iterated): any other child the process forks,
and the parent's collector, are left as Python has them. Not on free-threaded builds (there
``gc.freeze`` walks every object). ``STREAMDATA_FREEZE_AT_FORK=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading

from streamdata import config
from streamdata._fork import (
    at_fork_before,
    at_fork_in_child,
    at_fork_in_parent,
    starting_dataloader_worker,
)

__all__ = ["freeze_inherited", "keep_freed_memory"]

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the adaptive threshold's ceiling on 64-bit (older glibc: the most allowed)
TRIM_THRESHOLD = 256 << 20


def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc on Linux (musl's ``mallopt`` does nothing)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  # glibc only
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Tune this process's glibc malloc to keep freed memory; False where that is not
    possible (not Linux, not glibc)."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


# free-threaded builds' gc.freeze walks every object (not a list splice): no gain there
_FREE_THREADED = hasattr(sys, "_is_gil_enabled") and not sys._is_gil_enabled()
_PAUSE_WAIT_S = 1.0
_pause = threading.Lock()
_pauses = [0, False]  # forks between their before and after hooks; whether the collector was on


def _pause_for_fork() -> None:
    """Before a fork, in the forking thread: no collection may run in the child before the
    freeze (other modules' after-fork hooks run before ours and allocate)."""
    if _FREE_THREADED or not config.freeze_at_fork() or not _pause.acquire(timeout=_PAUSE_WAIT_S):
        return  # (a holder only counts: never long) unpaused, the freeze still comes, a little later
    try:
        if _pauses[0] == 0:
            _pauses[1] = gc.isenabled()
            gc.disable()
        _pauses[0] += 1
    finally:
        _pause.release()


def _resume_in_parent() -> None:
    held = _pause.acquire(timeout=_PAUSE_WAIT_S)  # not held: the count is still ours to undo
    try:
        if _pauses[0]:
            _pauses[0] -= 1
            if _pauses[0] == 0 and _pauses[1]:
                gc.enable()
    finally:
        if held:
            _pause.release()


def freeze_inherited() -> None:
    """INHERITED-HEAP: in a forked DataLoader worker, hide every inherited object from its collector."""
    if config.freeze_at_fork() and not _FREE_THREADED:
        gc.freeze()


def _reset_in_child() -> None:
    """In every forked child: the pause's lock and count start afresh (another thread may have
    held the parent's lock, or paused for a worker's fork, at this fork); a worker freezes."""
    global _pause
    _pause = threading.Lock()
    if starting_dataloader_worker():
        freeze_inherited()
    if _pauses[0]:
        _pauses[0] = 0
        if _pauses[1]:
            gc.enable()


at_fork_before(_pause_for_fork, workers_only=True)
at_fork_in_parent(_resume_in_parent, workers_only=True)
at_fork_in_child("heap", _reset_in_child)
