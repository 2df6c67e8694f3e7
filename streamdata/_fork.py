"""The package's one ``os.register_at_fork`` hook: the resets a forked child runs, in a fixed order.

``import streamdata`` registers nothing with the interpreter. :func:`install` does, once: the
first time a dataset or ``sd.loader`` iterates, and the first time an owner below holds state a
child could inherit (a loop thread starts); the hooks then run at every fork of the process. An
owner calls :func:`install` *before* it holds such state, from whichever thread makes it: a
plain ``DataLoader`` forks its workers from a process that may never iterate, after a
constructor that only listed.

Invariant (FORK-RESET): a process forked from one that did I/O (a DataLoader worker) inherits
objects bound to threads and sockets that exist only in its parent. Right after the fork, in
the child, before any of its own code runs, each owner drops its inherited state, stage by
stage in ``STAGES`` order (within a stage, in registration order):

  heap      ``_alloc``: the child's garbage collector is told to leave every object it inherited
            alone (``gc.freeze``), before the child allocates anything (INHERITED-HEAP); only
            in a DataLoader worker's fork.
  loops     ``store.loop``: every inherited ``LoopThread`` is marked inherited and closed; its
            thread did not survive the fork, so it refuses work instead of hanging (LOOP-AFTER-FORK).
  sessions  ``store.client``: every inherited aiohttp session (and our HTTP/1.1 pool,
            ``store.http1``) is dropped without closing its connections; closing them in the child
            would close the parent's keep-alive sockets under it (seen: the parent's next request
            hung until its time-out).
            ``testing._loop``: a test's proxy and TLS front run in the parent; the child
            closes its copies of their sockets, so a connection ends when the parent's does.
  pools     ``batch.recycle``: a worker's buffer pool lends slots of its own board; a process
            forked from the worker starts with none (RECYCLE-HANDOFF).

What changes the interpreter itself (the heap freeze and the collector's pause around the
fork) acts only at a fork that starts a torch DataLoader worker
(:func:`starting_dataloader_worker`; ``at_fork_before``/``at_fork_in_parent`` with
``workers_only``): a plain ``os.fork()`` or a ``multiprocessing`` pool of the user's keeps the
interpreter as Python has it. A reset must not do I/O, take a lock another thread may have held at the fork,
or raise; nothing is reset for spawned processes (they inherit nothing). An owner registers
with ``at_fork_in_child(stage, reset)``; this module imports nothing from the package.

Two more hook lists, for an owner whose parent-side state must agree with what the child got
(``_alloc``'s collector pause): ``at_fork_before(hook)`` runs in the forking thread just before the fork (it
may take the owner's own lock, bounded by a time-out, so that no other thread changes that
state across the fork), ``at_fork_in_parent(hook)`` in the parent just after it (it releases
that lock). Same rules: no I/O beyond closing descriptors, never raise.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable
from types import FrameType

__all__ = ["STAGES", "at_fork_before", "at_fork_in_child", "at_fork_in_parent", "install",
           "installed", "starting_dataloader_worker"]

STAGES = ("heap", "loops", "sessions", "pools")

_RESETS: dict[str, list[Callable[[], None]]] = {stage: [] for stage in STAGES}
_BEFORE: list[Callable[[], None]] = []
_PARENT: list[Callable[[], None]] = []
_installs = itertools.count()  # next() is atomic: only the first caller of install() registers
_installed = False
_STACK_DEPTH = 16  # frames searched for the fork's caller: hook, runner, os.fork's caller, ...
_WORKER_MODULE = "torch.utils.data._utils.worker"


def install() -> None:
    """Register this module's hooks with ``os.register_at_fork`` (once; later calls do nothing)."""
    global _installed
    if _installed or not hasattr(os, "register_at_fork") or next(_installs):
        return
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
    _installed = True


def installed() -> bool:
    """Whether :func:`install` has registered the hooks in this process."""
    return _installed


def starting_dataloader_worker() -> bool:
    """Whether the fork under way starts a torch DataLoader worker; call it from a fork hook.

    The one place that knows torch's and ``multiprocessing``'s private names: torch starts each
    worker as ``Process(target=torch.utils.data._utils.worker._worker_loop)``, and a ``fork``
    context forks in ``multiprocessing.popen_fork.Popen._launch(self, process_obj)``, which is
    on the forking thread's stack (the parent's, and the child's copy of it) while the hooks
    run. A change on either side makes this False: workers then keep Python's collector
    (slower to start, still correct); ``tests/test_alloc.py`` notices.
    """
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_launch" and code.co_filename.endswith("popen_fork.py"):
            target = getattr(frame.f_locals.get("process_obj"), "_target", None)
            return getattr(target, "__module__", None) == _WORKER_MODULE
        frame = frame.f_back
    return False


def _only_in_workers(hook: Callable[[], None]) -> Callable[[], None]:
    def hook_in_workers() -> None:
        if starting_dataloader_worker():
            hook()

    return hook_in_workers


def at_fork_in_child(stage: str, reset: Callable[[], None]) -> None:
    """Run ``reset()`` in every child forked from now on, at ``stage`` of FORK-RESET, once
    :func:`install` has run (a reset that acts only in a DataLoader worker asks
    :func:`starting_dataloader_worker`)."""
    if stage not in _RESETS:
        raise ValueError(f"unknown fork-reset stage {stage!r}: one of {', '.join(STAGES)}")
    _RESETS[stage].append(reset)


def at_fork_before(hook: Callable[[], None], *, workers_only: bool = False) -> None:
    """Run ``hook()`` in the forking process just before every fork from now on (``workers_only``:
    every fork that starts a DataLoader worker)."""
    _BEFORE.append(_only_in_workers(hook) if workers_only else hook)


def at_fork_in_parent(hook: Callable[[], None], *, workers_only: bool = False) -> None:
    """Run ``hook()`` in the forking process just after every fork from now on (``workers_only``:
    every fork that starts a DataLoader worker)."""
    _PARENT.append(_only_in_workers(hook) if workers_only else hook)


def _run(hooks: list[Callable[[], None]]) -> BaseException | None:
    failed: BaseException | None = None
    for hook in list(hooks):
        try:
            hook()
        except Exception as exc:  # the other hooks still run; the first failure is reported
            failed = failed or exc
    return failed


def _before_fork() -> None:
    failed = _run(_BEFORE)
    if failed is not None:
        raise failed


def _after_fork_in_parent() -> None:
    failed = _run(_PARENT)
    if failed is not None:
        raise failed


def _after_fork_in_child() -> None:
    failed: BaseException | None = None
    for stage in STAGES:
        first = _run(_RESETS[stage])  # every stage runs, whatever failed before
        failed = failed or first
    if failed is not None:
        raise failed
