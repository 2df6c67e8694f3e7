"""A torchtitan-style loop over a 2-D ``DeviceMesh`` ("dp", "tp"), run by ``torchrun`` from
tests/test_dp_groups.py: docs/frameworks.md's recipe (the block between the markers below, kept
identical to the page by the test): tensor parallelism inside each replica, FSDP2 over the
replicas, ``sd.loader(..., mesh=mesh["dp"])``.

    python -m torch.distributed.run --nproc_per_node=4 tests/jobs/mesh_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``spec``, ``storage_options``, ``dp``, ``tp``. Each rank writes
``OUT_DIR/{tag}-rank{R}.json``: per epoch, its batches' keys step by step, and its mesh place.
"""

from __future__ import annotations

# --- recipe: docs/frameworks.md, A DeviceMesh loop (torchtitan-style) ---
import datetime

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import streamdata as sd


def train_step(model, optimizer, batch, epoch, step):  # your step
    loss = model(batch["npy"].float()).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def train(spec, storage_options, dp, tp, epochs=2):
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))  # "nccl" on GPUs
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))  # "cuda" on GPUs
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # in a replica
    fully_shard(model, mesh=mesh["dp"])  # across the replicas
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = sd.TarDataset(spec, storage_options=storage_options, shuffle=True, seed=0)  # rank 0 alone lists
    # the replicas split each epoch; the tp ranks of one replica get identical batches
    loader = sd.loader(ds, batch_size=8, num_workers=2, mesh=mesh["dp"])
    step = 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            step += 1
            train_step(model, optimizer, batch, epoch, step)
    loader.close()
    return mesh
# --- end of recipe ---


STEPS: dict[str, list[list[str]]] = {}
_recipe_step = train_step


def train_step(model, optimizer, batch, epoch, step):  # noqa: F811 - the recipe's, recorded
    _recipe_step(model, optimizer, batch, epoch, step)
    STEPS.setdefault(str(epoch), []).append(list(batch["__key__"]))


def main(out_dir: str, config_json: str) -> None:
    import json

    from tests.jobs._leave import leave

    cfg = json.loads(config_json)
    mesh = train(cfg["spec"], cfg["storage_options"], cfg["dp"], cfg["tp"])
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"steps": STEPS, "place": [mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()]}, f)
    leave()


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:3])
