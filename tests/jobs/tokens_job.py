"""A DDP job over ``sd.TokenDataset``, whole or stopped mid-epoch, or resumed; run by ``torchrun``
from tests/test_tokens_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/tokens_job.py OUT_DIR CONFIG_JSON

CONFIG: ``workers``, ``tag`` and ``cases``: per case name, ``spec``, ``options`` (the dataset's
keyword arguments), optionally its own ``workers``, and optionally ``stop`` + ``save`` (the
step after which every rank calls ``loader.state_dict()``; rank 0 writes it) or ``load`` (a
state file to resume from). Each rank trains a tiny DDP model (gloo, CPU) and writes
``OUT_DIR/{tag}-rank{R}.json``: per case, its steps, every rank's steps, and the sequences it
delivered (each followed by its labels, where the batches have them).
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


def run_case(case: dict, workers: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = sd.TokenDataset(case["spec"], **case["options"])
    seqs, steps = [], 0
    with sd.loader(ds, num_workers=workers) as loader:
        loader.set_epoch(1)
        features = lambda b: b["input_ids"][:, :4].float() / 1000  # noqa: E731
        for batch in ddp_steps(loader, model, optimizer, features, case, rank):
            steps += 1
            seqs += batch["input_ids"].tolist() if "labels" not in batch else [  # (a sequence and its labels)
                ids + labels for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist(),
                                                    strict=True)]
    all_steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_steps, steps)
    return {"steps": steps, "all_steps": all_steps, "seqs": seqs}


def main(out_dir: str, config_json: str) -> None:
    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    out = {name: run_case(case, case.get("workers", cfg["workers"]), rank)
           for name, case in cfg["cases"].items()}
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump(out, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
