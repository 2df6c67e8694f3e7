"""What the ranks of a job share: one gloo group, and work done once on rank 0 for all.

Invariant (LIST-ONCE): when ``torch.distributed`` is initialised with more than one rank, a
dataset's constructor expands its spec on rank 0 only and broadcasts the shards (or the error,
which every rank then raises) to the others over a gloo group, so a job of N ranks sends the
storage one listing, not N (a request storm at thousands of ranks). Every rank must build the
dataset (as every rank runs the same script), and the wait is bounded by the group's timeout.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["GROUP_TIMEOUT", "from_rank0", "gloo_group", "is_rank0", "multi_rank"]

T = TypeVar("T")
GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # as torch.distributed's default group
_GROUP: list[Any] = []  # the gloo group of this process's default group, made once


def multi_rank() -> bool:
    """True in a job of more than one rank with ``torch.distributed`` initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_rank0() -> bool:
    """True on rank 0 of a multi-rank job, and in a single process: where LIST-ONCE work runs."""
    if not multi_rank():
        return True
    import torch.distributed as dist

    return dist.get_rank() == 0


def gloo_group() -> Any:
    """A gloo group of every rank: the default group when it is gloo, else one made once (on
    every rank alike, at the same point of the program), so CPU objects travel under NCCL too."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))
    return _GROUP[0]


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` computed on rank 0 and shared with every rank (LIST-ONCE); in a single process,
    just ``fn()``. An exception on rank 0 is raised on every rank."""
    if not multi_rank():
        return fn()
    import torch.distributed as dist

    box: list[Any] = [None]
    if is_rank0():
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # every rank raises it, so none waits for the others
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0, group=gloo_group())
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
