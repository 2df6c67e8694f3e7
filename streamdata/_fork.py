"""The package's one ``os.register_at_fork`` hook: the resets a forked child runs, in a fixed order.

Invariant (FORK-RESET): a process forked from one that did I/O (a DataLoader worker) inherits
objects bound to threads and sockets that exist only in its parent. Right after the fork, in
the child, before any of its own code runs, each owner drops its inherited state, stage by
stage in ``STAGES`` order (within a stage, in registration order):

  loops     ``_aio``: every inherited ``LoopThread`` is marked inherited and closed; its thread
            did not survive the fork, so it refuses work instead of hanging (LOOP-AFTER-FORK).
  sessions  ``client``: every inherited aiohttp session (and LITE-HTTP pool, ``h1``) is dropped
            without closing its connections; closing them in the child would close the parent's keep-alive
            sockets under it (seen: the parent's next request hung until its time-out).
  pools     ``recycle``: a worker's buffer pool lends slots of its own board; a process forked
            from the worker starts with none (RECYCLE-HANDOFF).

A reset must not do I/O, take a lock another thread may have held at the fork, or raise;
nothing is reset for spawned processes (they inherit nothing). An owner registers with
``at_fork_in_child(stage, reset)``; this module imports nothing from the package.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["STAGES", "at_fork_in_child"]

STAGES = ("loops", "sessions", "pools")

_RESETS: dict[str, list[Callable[[], None]]] = {stage: [] for stage in STAGES}


def at_fork_in_child(stage: str, reset: Callable[[], None]) -> None:
    """Run ``reset()`` in every child forked from now on, at ``stage`` of FORK-RESET."""
    if stage not in _RESETS:
        raise ValueError(f"unknown fork-reset stage {stage!r}: one of {', '.join(STAGES)}")
    _RESETS[stage].append(reset)


def _after_fork_in_child() -> None:
    failed: BaseException | None = None
    for stage in STAGES:
        for reset in list(_RESETS[stage]):
            try:
                reset()
            except Exception as exc:  # the other resets still run; the first failure is reported
                failed = failed or exc
    if failed is not None:
        raise failed


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
