"""A Lightning Fabric job over sd.loader, run by ``torchrun`` from tests/test_frameworks.py:
docs/frameworks.md's recipe (the block between the markers below, kept identical to the page by
the test), trained for two epochs with ``fabric.save`` at every step; a first run stops at a
seeded step (an exception on every rank), the second resumes with ``fabric.load``. Also what
``fabric.setup_dataloaders`` says to an ``sd.loader``.

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/fabric_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``spec``, ``storage_options``, ``ckpt_path`` and ``stop`` (the global step at which
the first run fails). Each rank writes ``OUT_DIR/{tag}-rank{R}.json``: per epoch, the keys it
trained, its steps, and ``setup_dataloaders``' error.
"""

from __future__ import annotations

# --- recipe: docs/frameworks.md, Lightning Fabric ---
import os

import lightning as L
import torch

import streamdata as sd


def train_step(fabric, model, optimizer, batch, epoch, step):  # your step
    loss = model(batch["npy"].float()).square().mean()
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def fit(spec, storage_options, ckpt_path, epochs=2, every_n_steps=100):
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()  # under torchrun: the processes are there already
    ds = sd.TarDataset(spec, storage_options=storage_options, shuffle=True, seed=0)  # rank 0 alone lists
    loader = sd.loader(ds, batch_size=8, num_workers=2)  # used as it is: no setup_dataloaders
    model = torch.nn.Linear(8, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if os.path.exists(ckpt_path):
        fabric.load(ckpt_path, state)  # the loader's position too (load_state_dict)
    epoch = ds.epoch  # the epoch loaded (0 on a fresh start)
    while epoch < epochs:
        for batch in loader:
            state["step"] += 1
            train_step(fabric, model, optimizer, batch, epoch, state["step"])
            if state["step"] % every_n_steps == 0:
                fabric.save(ckpt_path, state)  # every rank: the loader's state is a collective
        epoch += 1
        loader.set_epoch(epoch)
    return fabric, loader
# --- end of recipe ---


class Stop(Exception):
    """The seeded failure."""


RUN: dict = {"trained": {}, "steps": 0, "stop": None, "fabric": None}
_recipe_step = train_step


def train_step(fabric, model, optimizer, batch, epoch, step):  # noqa: F811 - the recipe's, recorded
    RUN["fabric"] = fabric
    if step == RUN["stop"]:  # after the checkpoint of the step before
        raise Stop(step)
    _recipe_step(fabric, model, optimizer, batch, epoch, step)
    RUN["trained"].setdefault(str(epoch), []).extend(batch["__key__"])
    RUN["steps"] += 1


def main(out_dir: str, config_json: str) -> None:
    import json

    import torch.distributed as dist

    from tests.jobs._leave import leave

    cfg = json.loads(config_json)
    RUN["stop"] = cfg.get("stop")
    try:
        fit(cfg["spec"], cfg["storage_options"], cfg["ckpt_path"], every_n_steps=1)
    except Stop:
        pass
    try:
        probe = sd.loader(sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"]), batch_size=8,
                          num_workers=0)
        RUN["fabric"].setup_dataloaders(probe)
        refusal = None
    except TypeError as exc:
        refusal = str(exc)
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"trained": RUN["trained"], "steps": RUN["steps"], "refusal": refusal}, f)
    leave()


if __name__ == "__main__":
    import sys

    main(*sys.argv[1:3])
