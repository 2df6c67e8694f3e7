"""How the torchrun test jobs end: every result is written before this is called; and, when
another rank failed and torchrun stops this one (SIGTERM), where each of its threads was."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

import torch.distributed as dist

# A rank that another rank waited for (a gloo timeout there) is stopped by torchrun with SIGTERM:
# its threads' stacks go to stderr first, which the failing test shows (``helpers.torchrun``).
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


def leave() -> None:
    """Destroy the process group and leave without the interpreter's teardown, where torch's
    threads once aborted a 3-rank job under load ("terminate called without an active
    exception", after every rank had written its results). Not ours: at that point no thread of
    ours is alive, but gloo's (gloo_tcp_loop, pt_gloo_runloop) still are: they outlive
    destroy_process_group (and gc.collect) once torch._dynamo is imported (a torch.optim
    optimizer's first construction imports it; reproduced without streamdata)."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
