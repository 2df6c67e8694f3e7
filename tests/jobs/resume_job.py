"""A DDP job that stops mid-epoch and saves, or resumes; run by ``torchrun`` from tests/test_resume_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/resume_job.py OUT_DIR CONFIG_JSON

CONFIG: ``spec``, ``storage_options``, ``workers``, ``tag``, and either ``stop`` (the step after
which every rank calls ``loader.state_dict()``, a collective; rank 0 writes it to ``save``) or
``load`` (a state file to resume from). Each rank trains a tiny DDP model (gloo, CPU) and writes
``OUT_DIR/{tag}-rank{R}.json``: its steps, every rank's steps, the keys it delivered.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

import streamdata as sd
from tests.jobs._leave import leave


def main(out_dir: str, config_json: str) -> None:
    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    shuffle = ({"shuffle": "block", "shuffle_window": 8} if cfg.get("shuffle") == "block"
               else {"shuffle": True, "shuffle_buffer": 16})  # BLOCK-SHUFFLE, or RESUME-BUFFER
    ds = sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"], seed=3, **shuffle)
    keys, steps = [], 0
    with sd.loader(ds, batch_size=4, num_workers=cfg["workers"]) as loader:
        loader.set_epoch(1)
        if cfg.get("load"):
            with open(cfg["load"]) as f:
                loader.load_state_dict(json.load(f))
        for batch in loader:
            loss = model(batch["npy"].float()).square().mean()  # DDP all-reduces the grads
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
            keys += list(batch["__key__"])
            if steps == cfg.get("stop"):
                state = loader.state_dict()  # every rank's positions (a collective)
                if rank == 0:
                    with open(cfg["save"], "w") as f:
                        json.dump(state, f)
                break
    all_steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_steps, steps)
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump({"steps": steps, "all_steps": all_steps, "keys": keys}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
