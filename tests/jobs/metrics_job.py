"""``loader.metrics(all_ranks=True)`` in a real ``torchrun`` job, from tests/feed/test_metrics.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/metrics_job.py OUT_DIR CONFIG

CONFIG: ``tag`` and ``spec`` (local tar shards). Each rank (gloo, CPU, one worker) reads one
epoch with ``end_together=False`` (so one rank's waits do not become the other's); rank 1's
``map`` sleeps, so it is the straggler. Each rank writes its own ``metrics()`` and the gathered
dict to ``OUT_DIR/{tag}-rank{R}.json``.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch.distributed as dist

import streamdata as sd
from tests.jobs._leave import leave


def _slow(sample: dict) -> dict:
    # 40 ms a sample, about 2 s over the epoch: more than a loaded machine's start-up noise
    time.sleep(0.04)
    return sample


def main(out_dir: str, config_json: str) -> None:
    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    ds = sd.TarDataset(cfg["spec"], index=None, map=_slow if rank == 1 else None)
    with sd.loader(ds, batch_size=4, num_workers=1, end_together=False) as loader:
        for _ in loader:
            time.sleep(0.002)
        mine = loader.metrics()
        gathered = loader.metrics(all_ranks=True)
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump({"mine": mine, "all": gathered}, f)
    dist.barrier()
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
