"""Ranks end an epoch together, for data whose ranks may hold different numbers of batches.

Invariant (END-TOGETHER): in a multi-rank job, before each batch is handed to the training loop,
every rank says whether it has one: an all-reduce (MIN) of one integer on a gloo group (the
default group if it is gloo, else one made once for this, so it works under NCCL too). The
epoch ends on every rank at the first step where some rank has none, so no rank waits in a
collective of the training step for a rank that has run out (the DDP hang at the end of an
epoch). A rank that still had batches reads the rest of its share without handing it on (its
workers then end the epoch cleanly) and counts those samples as undelivered. A rank whose
loading failed says so (-1): the others raise instead of waiting for it. Every wait is bounded
by the group's timeout.

With a sample index (exact epochs) the ranks hold equal numbers of batches and this ends
nothing early; it costs one small all-reduce per step (benchmarks/README.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from streamdata.errors import StreamDataError
from streamdata.ranks import gloo_group, multi_rank

__all__ = ["EndTogether", "samples_in"]

log = logging.getLogger("streamdata")

_HAVE, _DONE, _FAILED = 1, 0, -1


def samples_in(batch: Any) -> int:
    """How many samples a batch holds: a dict's ``__key__`` list or first tensor, a sequence's
    first element, a tensor's first dimension; 1 for anything else (one sample)."""
    if isinstance(batch, dict):
        first = batch.get("__key__", next(iter(batch.values()), None))
        return samples_in(first) if first is not None else 1
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return len(batch) if isinstance(batch[0], (str, bytes)) else samples_in(batch[0])
    return 1


class EndTogether:
    """Wraps one rank's batches of each pass so that all ranks end it at the same step."""

    def __init__(self) -> None:
        self.undelivered = 0  # samples of the last pass this rank read and did not hand on
        self.steps = 0  # batches the last pass handed on

    active = staticmethod(multi_rank)

    def _agree(self, flag: int) -> int:
        import torch.distributed as dist

        value = torch.tensor([flag], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=gloo_group())
        return int(value.item())

    def wrap(self, batches: Iterator[Any]) -> Iterator[Any]:
        self.undelivered, self.steps = 0, 0
        while True:
            try:
                batch, flag = next(batches), _HAVE
            except StopIteration:
                batch, flag = None, _DONE
            except BaseException:
                self._agree(_FAILED)  # the other ranks raise instead of waiting for this one
                raise
            agreed = self._agree(flag)
            if agreed == _FAILED:
                raise StreamDataError("another rank's data loading failed; its log has the error")
            if agreed == _DONE:
                if batch is not None:
                    self._finish(batch, batches)
                return
            self.steps += 1
            yield batch
            del batch

    def _finish(self, batch: Any, rest: Iterator[Any]) -> None:
        import torch.distributed as dist

        self.undelivered = samples_in(batch)
        del batch
        for more in rest:
            self.undelivered += samples_in(more)
        log.warning("streamdata: rank %d ended the epoch with the other ranks after %d batches; "
                    "%d samples of its share were not delivered (ranks held different amounts of "
                    "data: shards of unequal size, or a shard count that is not a multiple of "
                    "ranks x workers)", dist.get_rank(), self.steps, self.undelivered)
