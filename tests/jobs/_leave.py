"""How the torchrun test jobs end: every result is written before this is called."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def leave() -> None:
    """Destroy the process group and leave without the interpreter's teardown, where torch's
    threads once aborted a 3-rank job under load ("terminate called without an active
    exception", after every rank had written its results). Not ours to fix here; noted."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
