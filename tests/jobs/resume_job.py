"""A DDP job that stops mid-epoch and saves, or resumes; run by ``torchrun`` from tests/test_resume_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/resume_job.py OUT_DIR CONFIG_JSON

CONFIG: ``workers``, ``tag`` and ``cases``: per case name, ``kind`` ("tar", "parquet" or
"arrow"), ``spec``, ``storage_options``, ``shuffle_buffer`` (or "block"), and either ``stop`` (the step after
which every rank calls ``loader.state_dict()``, a collective; rank 0 writes it to ``save``) or
``load`` (a state file to resume from). The cases run one after the other in one launch (one
torchrun start for every format). Each rank trains a tiny DDP model (gloo, CPU) and writes
``OUT_DIR/{tag}-rank{R}.json``: per case, its steps, every rank's steps, the keys it delivered.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

import streamdata as sd
from tests.helpers import ddp_steps
from tests.jobs._leave import leave

DATASETS = {"tar": sd.TarDataset, "parquet": sd.ParquetDataset, "arrow": sd.ArrowDataset}


def _keys(batch) -> list:
    return list(batch["__key__"]) if "__key__" in batch else batch["id"].tolist()


def _features(batch) -> torch.Tensor:
    if "npy" in batch:
        return batch["npy"].float()
    return batch["id"].float()[:, None].repeat(1, 8)


def run_case(case: dict, workers: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shuffle = ({"shuffle": "block", "shuffle_window": 8} if case["shuffle_buffer"] == "block"
               else {"shuffle": True, "shuffle_buffer": case["shuffle_buffer"]})  # BLOCK-SHUFFLE or a buffer
    ds = DATASETS[case["kind"]](case["spec"], storage_options=case["storage_options"], seed=3, **shuffle)
    keys, steps = [], 0
    with sd.loader(ds, batch_size=4, num_workers=workers) as loader:
        loader.set_epoch(1)
        for batch in ddp_steps(loader, model, optimizer, _features, case, rank):
            steps += 1
            keys += _keys(batch)
    all_steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_steps, steps)
    return {"steps": steps, "all_steps": all_steps, "keys": keys}


def main(out_dir: str, config_json: str) -> None:
    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    results = {name: run_case(case, cfg["workers"], rank) for name, case in cfg["cases"].items()}
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
