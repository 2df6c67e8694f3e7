"""A DDP training job over uneven shards, run by ``torchrun`` from tests/test_ddp.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/ddp_uneven.py OUT_DIR CASES_JSON

Each rank trains a tiny DDP model (gloo, CPU) for two epochs per case through ``sd.loader``
(2 workers, batch 8) and writes what it saw to ``OUT_DIR/rank{R}.json``: per case and epoch,
its steps, the keys it delivered and ``loader.undelivered``. A rank that ran out while
another had batches would hang in DDP's all-reduce: the test's time limit catches that.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist

import streamdata as sd


def main(out_dir: str, cases_json: str) -> None:
    cases = json.loads(cases_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    results: dict[str, list[dict]] = {}
    for name, case in cases.items():
        ds = sd.TarDataset(case["spec"], storage_options=case["storage_options"], batch_size=8,
                           shuffle=True, seed=3)
        with sd.loader(ds, num_workers=2) as loader:
            epochs = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                steps, keys = 0, []
                for batch in loader:
                    loss = model(batch["npy"].float()).square().mean()  # DDP all-reduces the grads
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    steps += 1
                    keys += list(batch["__key__"])
                # an epoch-end collective, as evaluation or a checkpoint barrier would be: with
                # unequal steps it meets a DDP all-reduce of the other rank and fails or hangs
                all_steps: list = [None] * dist.get_world_size()
                dist.all_gather_object(all_steps, steps)
                epochs.append({"steps": steps, "all_steps": all_steps, "keys": keys,
                               "undelivered": loader.undelivered})
        results[name] = epochs
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
