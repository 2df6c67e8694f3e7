"""A Hugging Face Accelerate job over sd.loader, run by ``torchrun`` from
tests/test_frameworks.py: docs/frameworks.md's recipe (the block between the markers below, kept
identical to the page by the test), trained for two epochs with ``save_state`` at every step; a
first run stops at a seeded step (an exception on every rank), the second resumes with
``load_state``. Then a plain ``DataLoader`` over the same dataset goes through ``prepare()``: its
first iteration is refused (SELF-SPLIT).

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/accelerate_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``spec``, ``storage_options``, ``ckpt_dir``, ``resume`` and ``stop`` (the global
step at which the first run fails). Each rank writes ``OUT_DIR/{tag}-rank{R}.json``: per epoch,
the keys it trained, its steps, whether ``prepare`` returned the loader itself, and the plain
DataLoader's refusal.
"""

from __future__ import annotations

import json
import sys

# --- recipe: docs/frameworks.md, Accelerate ---
import torch
from accelerate import Accelerator

import streamdata as sd


def train_step(accelerator, model, optimizer, batch, epoch, step):  # your step
    loss = model(batch["npy"].float()).square().mean()
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()


def fit(spec, storage_options, ckpt_dir, resume=False, epochs=2, every_n_steps=100):
    accelerator = Accelerator(cpu=True)  # under torchrun / accelerate launch: torch.distributed is up
    ds = sd.TarDataset(spec, storage_options=storage_options, shuffle=True, seed=0)  # rank 0 alone lists
    loader = sd.loader(ds, batch_size=8, num_workers=2)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # the loader, unchanged
    accelerator.register_for_checkpointing(loader)  # its state goes in save_state()
    if resume:
        accelerator.load_state(ckpt_dir)  # the model, the optimizer and the loader's position
    epoch, step = ds.epoch, 0  # the epoch loaded (0 on a fresh start)
    while epoch < epochs:
        for batch in loader:
            step += 1
            train_step(accelerator, model, optimizer, batch, epoch, step)
            if step % every_n_steps == 0:
                accelerator.save_state(ckpt_dir)  # every rank: the loader's state is a collective
        epoch += 1
        loader.set_epoch(epoch)
    return loader
# --- end of recipe ---


class Stop(Exception):
    """The seeded failure."""


RUN: dict = {"trained": {}, "steps": 0, "stop": None}
_recipe_step = train_step


def train_step(accelerator, model, optimizer, batch, epoch, step):  # noqa: F811 - the recipe's, recorded
    if step == RUN["stop"]:  # after the checkpoint of the step before
        raise Stop(step)
    _recipe_step(accelerator, model, optimizer, batch, epoch, step)
    RUN["trained"].setdefault(str(epoch), []).extend(batch["__key__"])
    RUN["steps"] += 1


def main(out_dir: str, config_json: str) -> None:
    import torch.distributed as dist

    from tests.jobs._leave import leave

    cfg = json.loads(config_json)
    RUN["stop"] = cfg.get("stop")
    try:
        fit(cfg["spec"], cfg["storage_options"], cfg["ckpt_dir"], resume=cfg["resume"], every_n_steps=1)
    except Stop:
        pass
    accelerator = Accelerator(cpu=True)
    probe = sd.loader(sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"]), batch_size=8,
                      num_workers=0)
    passed = accelerator.prepare(probe)
    plain = accelerator.prepare(torch.utils.data.DataLoader(
        sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"]), batch_size=8))
    try:
        next(iter(plain))
        refusal = None
    except sd.SpecError as exc:
        refusal = str(exc)
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"trained": RUN["trained"], "steps": RUN["steps"], "passed_through": passed is probe,
                   "refusal": refusal}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
