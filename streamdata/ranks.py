"""What the ranks of a job share: one gloo group; work done once on rank 0 for all, or split among them.

Invariant (LIST-ONCE): when ``torch.distributed`` is initialised with more than one rank, a
dataset's constructor expands its spec on rank 0 only and broadcasts the shards (or the error,
which every rank then raises) to the others over a gloo group, so a job of N ranks sends the
storage one listing, not N (a request storm at thousands of ranks). Every rank must build the
dataset (as every rank runs the same script), and the wait is bounded by the group's timeout.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from streamdata.config import env_int, env_str
from streamdata.errors import SpecError, StreamDataError

__all__ = ["GROUP_TIMEOUT", "DataParallel", "data_parallel", "each_rank", "from_rank0", "gloo_group",
           "is_rank0", "launcher_place", "multi_rank"]

log = logging.getLogger("streamdata")

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


def each_rank(fn: Callable[[int, int], T]) -> list[T]:
    """``fn(rank, world_size)`` run on every rank, each with its own share of some work, and every
    rank's result, in rank order, on every rank (an all-gather over the gloo group); in a single
    process, ``[fn(0, 1)]``. An exception on any rank is raised on every rank (the lowest rank's),
    so none waits for the others; the wait is bounded by the group's timeout."""
    if not multi_rank():
        return [fn(0, 1)]
    import pickle

    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    try:
        mine: tuple[str, Any] = ("ok", fn(rank, size))
    except Exception as exc:  # every rank raises it
        try:
            pickle.dumps(exc)
            mine = ("error", exc)
        except Exception:  # (one that cannot travel still ends every rank's wait)
            mine = ("error", StreamDataError(f"rank {rank}: {type(exc).__name__}: {exc}"))
    every: list[Any] = [None] * size
    dist.all_gather_object(every, mine, group=gloo_group())
    for kind, value in every:
        if kind == "error":
            raise value
    return [value for _, value in every]


@dataclass(frozen=True)
class DataParallel:
    """This rank's place among the data-parallel replicas of a job that also splits the model
    (tensor, context or pipeline parallelism): the ``size`` replicas split each epoch, and every
    rank of one replica (same ``rank``) reads the same plan, so they see identical batches."""

    rank: int
    size: int
    # where the place came from: given, or a framework's (``launcher_place``)
    source: str = field(default="given", compare=False)


def data_parallel(dp_rank: int | None = None, dp_size: int | None = None, *, mesh: Any = None,
                  group: Any = None) -> DataParallel | None:
    """The data-parallel place given as ``dp_rank``/``dp_size``, a one-dimensional ``DeviceMesh``
    (``mesh["dp"]``) or a process group of one replica's peers across replicas; None when none
    is given (then every rank is its own replica). Several forms at once are refused; in a
    multi-rank job every rank's place is gathered and checked (a collective: every rank builds
    the dataset or loader), so a wrong group fails at once, on every rank, not as wrong data."""
    given = [name for name, value in (("dp_rank/dp_size", dp_rank if dp_rank is not None else dp_size),
                                      ("mesh", mesh), ("group", group)) if value is not None]
    if not given:
        found = launcher_place()
        if found is not None and multi_rank():
            _check_replicas(found)
        return found
    if len(given) > 1:
        raise SpecError(f"give the data-parallel group one way, not {' and '.join(given)}")
    if mesh is not None:
        if getattr(mesh, "ndim", 1) != 1:
            names = getattr(mesh, "mesh_dim_names", None)
            raise SpecError(f"mesh= takes the data-parallel dimension of the DeviceMesh (a 1-D mesh, "
                            f"e.g. mesh['dp']), not the whole {mesh.ndim}-D mesh (dimensions {names})")
        dp_rank, dp_size = int(mesh.get_local_rank()), int(mesh.size())
    elif group is not None:
        import torch.distributed as dist

        dp_rank, dp_size = int(dist.get_rank(group)), int(dist.get_world_size(group))
        if dp_rank < 0:
            raise SpecError("group= is a process group this rank is not in: give the data-parallel "
                            "group this rank belongs to")
    if dp_rank is None or dp_size is None:
        raise SpecError("dp_rank= and dp_size= go together")
    if not (isinstance(dp_rank, int) and isinstance(dp_size, int) and 0 <= dp_rank < dp_size):
        raise SpecError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank!r}, dp_size={dp_size!r}")
    place = DataParallel(dp_rank, dp_size)
    if multi_rank():
        _check_replicas(place)
    return place


def launcher_place() -> DataParallel | None:
    """LAUNCHER-PLACE: the data-parallel place a framework has set up where it says so without
    doubt, else None (every rank its own replica; nothing is guessed). Megatron's
    ``parallel_state`` once initialised (its data-parallel rank and size); ``accelerate launch``
    with a parallelism config (``ACCELERATE_USE_PARALLELISM_CONFIG``: its mesh puts the
    data-parallel dimensions outermost, so a replica is ``tp * cp * sp`` consecutive ranks).
    A place given to the dataset or the loader wins. Logged once per place, at INFO."""
    found: DataParallel | None = None
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        found = DataParallel(int(ps.get_data_parallel_rank()), int(ps.get_data_parallel_world_size()),
                             "Megatron's parallel_state")
    elif (env_str("ACCELERATE_USE_PARALLELISM_CONFIG") or "").lower() == "true":
        found = _accelerate_place()
    if found is not None and found not in _LOGGED:
        _LOGGED.add(found)
        log.info("data-parallel replica %d of %d, from %s", found.rank, found.size, found.source)
    return found


_LOGGED: set[DataParallel] = set()


def _accelerate_place() -> DataParallel | None:
    def size(name: str) -> int:
        return env_int(f"PARALLELISM_CONFIG_{name}_SIZE", 1) or 1

    inner, replicas = size("TP") * size("CP") * size("SP"), size("DP_REPLICATE") * size("DP_SHARD")
    if inner == 1:
        return None  # every rank a replica: nothing to change
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if on else env_int("RANK", 0) or 0
    world = dist.get_world_size() if on else env_int("WORLD_SIZE", 1) or 1
    if replicas * inner != world:
        raise SpecError(f"accelerate's parallelism config (PARALLELISM_CONFIG_*) gives {replicas} data-"
                        f"parallel x {inner} model-parallel ranks, the job has {world}: give the place "
                        "with sd.loader(..., mesh=accelerator.torch_device_mesh['dp'])")
    return DataParallel(rank // inner, replicas, "accelerate's parallelism config")


def _check_replicas(place: DataParallel) -> None:
    """Every rank gives the same ``size``, and each replica has as many ranks as every other."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (place.rank, place.size), group=gloo_group())
    sizes = {size for _, size in every}
    if len(sizes) > 1:
        raise SpecError(f"the ranks give different data-parallel sizes: {sorted(sizes)}")
    per = [sum(1 for r, _ in every if r == dp) for dp in range(place.size)]
    if len(set(per)) != 1 or len(every) != place.size * per[0]:
        raise SpecError(f"{len(every)} ranks cannot form {place.size} equal data-parallel replicas: ranks "
                        f"per replica {per} (each rank's dp_rank, by global rank: "
                        f"{[r for r, _ in every]})")
