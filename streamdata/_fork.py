"""The package's one ``os.register_at_fork`` hook: the resets a forked child runs, in a fixed order.

Invariant (FORK-RESET): a process forked from one that did I/O (a DataLoader worker) inherits
objects bound to threads and sockets that exist only in its parent. Right after the fork, in
the child, before any of its own code runs, each owner drops its inherited state, stage by
stage in ``STAGES`` order (within a stage, in registration order):

  heap      ``_alloc``: the child's garbage collector is told to leave every object it inherited
            alone (``gc.freeze``), before the child allocates anything (INHERITED-HEAP).
  loops     ``_aio``: every inherited ``LoopThread`` is marked inherited and closed; its thread
            did not survive the fork, so it refuses work instead of hanging (LOOP-AFTER-FORK).
  sessions  ``client``: every inherited aiohttp session (and LITE-HTTP pool, ``h1``) is dropped
            without closing its connections; closing them in the child would close the parent's keep-alive
            sockets under it (seen: the parent's next request hung until its time-out).
            ``handover``: of the idle connections offered for the next reader, the child keeps
            the one its parent handed it and closes its copies of the others' descriptors
            (never ``shutdown``: the connections are the parent's) (WARM-HANDOVER).
  pools     ``recycle``: a worker's buffer pool lends slots of its own board; a process forked
            from the worker starts with none (RECYCLE-HANDOFF).

A reset must not do I/O, take a lock another thread may have held at the fork, or raise;
nothing is reset for spawned processes (they inherit nothing). An owner registers with
``at_fork_in_child(stage, reset)``; this module imports nothing from the package.

Two more hook lists, for an owner whose parent-side state must agree with what the child got
(``handover``): ``at_fork_before(hook)`` runs in the forking thread just before the fork (it
may take the owner's own lock, bounded by a time-out, so that no other thread changes that
state across the fork), ``at_fork_in_parent(hook)`` in the parent just after it (it releases
that lock). Same rules: no I/O beyond closing descriptors, never raise.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["STAGES", "at_fork_before", "at_fork_in_child", "at_fork_in_parent"]

STAGES = ("heap", "loops", "sessions", "pools")

_RESETS: dict[str, list[Callable[[], None]]] = {stage: [] for stage in STAGES}
_BEFORE: list[Callable[[], None]] = []
_PARENT: list[Callable[[], None]] = []


def at_fork_in_child(stage: str, reset: Callable[[], None]) -> None:
    """Run ``reset()`` in every child forked from now on, at ``stage`` of FORK-RESET."""
    if stage not in _RESETS:
        raise ValueError(f"unknown fork-reset stage {stage!r}: one of {', '.join(STAGES)}")
    _RESETS[stage].append(reset)


def at_fork_before(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in the forking process just before every fork from now on."""
    _BEFORE.append(hook)


def at_fork_in_parent(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in the forking process just after every fork from now on."""
    _PARENT.append(hook)


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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
