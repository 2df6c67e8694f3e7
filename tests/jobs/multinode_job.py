"""One rank of a two-node job: two ``torchrun`` agents on loopback (c10d rendezvous), each node
with its own ``cache_dir`` shared by its ranks; run from tests/test_frameworks.py. The block
between the markers is docs/frameworks.md's recipe, kept identical to the page by the test.

    python -m torch.distributed.run --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d \\
        --rdzv_endpoint=127.0.0.1:PORT --node_rank=N tests/jobs/multinode_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``node``, ``spec``, ``storage_options``, ``cache_dir`` (this node's). Each rank
writes ``OUT_DIR/{tag}-rank{R}.json``: its node, per epoch the keys it trained, its steps, and
its readers' cache hits and misses after each epoch.
"""

from __future__ import annotations

# --- recipe: docs/frameworks.md, Several nodes ---
import datetime

import torch
import torch.distributed as dist

import streamdata as sd


def train(spec, storage_options, cache_dir, epochs=2, on_batch=None, on_epoch_end=None):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))  # "nccl" on GPUs
    # rank 0 of the job lists the bucket and reads the index once, for every rank of every node;
    # cache_dir: a local disk of this node, shared by its ranks (later epochs read it, not the bucket)
    ds = sd.TarDataset(spec, storage_options=storage_options, cache=sd.Cache(dir=cache_dir))
    loader = sd.loader(ds, batch_size=8, num_workers=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            loss = model(batch["npy"].float()).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if on_batch:
                on_batch(epoch, batch)
        if on_epoch_end:
            on_epoch_end(epoch, ds)
    loader.close()
# --- end of recipe ---


def main(out_dir: str, config_json: str) -> None:
    import json

    from tests.jobs._leave import leave

    cfg = json.loads(config_json)
    out: dict = {"node": cfg["node"], "trained": {}, "steps": 0, "cache": []}

    def on_batch(epoch, batch):
        out["trained"].setdefault(str(epoch), []).extend(batch["__key__"])
        out["steps"] += 1

    def on_epoch_end(epoch, ds):
        out["cache"].append({k: int(ds.counts[f"cache.{k}"]) for k in ("hits", "misses")})

    train(cfg["spec"], cfg["storage_options"], cfg["cache_dir"], on_batch=on_batch, on_epoch_end=on_epoch_end)
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    leave()


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:3])
