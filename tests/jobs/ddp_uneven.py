"""A DDP training job over uneven shards, run by ``torchrun`` from tests/test_ddp.py.

    python -m torch.distributed.run --nproc_per_node=2 tests/jobs/ddp_uneven.py OUT_DIR CONFIG

CONFIG: ``tag`` (names the output) and ``cases`` (per case name, as below). Each rank trains
a tiny DDP model (gloo, CPU) for two epochs per case (2 workers, batch 8) and writes what it
saw to ``OUT_DIR/{tag}-rank{R}.json``: per case and epoch, its steps, batch sizes, the keys
(tar) or ids (Parquet) it delivered, ``loader.undelivered`` and the dataset's counters. A case
names its format (``kind``: tar, parquet), ``index`` (tar: "auto" or None), ``drop_last``, and
``loader``: ``sd`` (sd.loader, batching in the workers) or ``plain`` (a plain DataLoader over
a dataset that batches, with no help at the epoch's end). A rank that ran out while another
had batches would hang in DDP's all-reduce: the test's time limit catches that.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch
import torch.distributed as dist

import streamdata as sd
from tests.helpers import ddp_job
from tests.jobs._leave import leave


def main(out_dir: str, config_json: str) -> None:
    cfg, rank, model, optimizer = ddp_job(config_json)
    results: dict[str, list[dict]] = {}
    for name, case in cfg["cases"].items():
        plain, drop_last = case.get("loader", "sd") == "plain", case.get("drop_last", False)
        options = dict(storage_options=case["storage_options"], shuffle=True, seed=3)
        if plain:  # the dataset batches; with sd.loader, the loader does (in the workers)
            options.update(batch_size=8, drop_last=drop_last)
        if case.get("kind", "tar") == "parquet":
            ds = sd.ParquetDataset(case["spec"], **options)
        else:
            ds = sd.TarDataset(case["spec"], index=case.get("index", "auto"), **options)
        with (contextlib.nullcontext(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
              if plain else sd.loader(ds, batch_size=8, drop_last=drop_last, num_workers=2)) as loader:
            epochs = []
            for epoch in range(2):
                (ds if plain else loader).set_epoch(epoch)
                try:
                    length = len(loader)  # the plan's steps on this rank (None: no counts)
                except TypeError:
                    length = None
                steps, keys, sizes = 0, [], []
                for batch in loader:
                    x = batch["npy"] if "npy" in batch else batch["x"].reshape(-1, 1).expand(-1, 8)
                    loss = model(x.float()).square().mean()  # DDP all-reduces the grads
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    steps += 1
                    ids = batch["__key__"] if "__key__" in batch else batch["id"].tolist()
                    keys += list(ids)
                    sizes.append(len(ids))
                # an epoch-end collective, as evaluation or a checkpoint barrier would be: with
                # unequal steps it meets a DDP all-reduce of the other rank and fails or hangs
                all_steps: list = [None] * dist.get_world_size()
                dist.all_gather_object(all_steps, steps)
                epochs.append({"steps": steps, "all_steps": all_steps, "keys": keys, "sizes": sizes,
                               "len": length, "undelivered": 0 if plain else loader.undelivered,
                               "counts": ds.counts})
        results[name] = epochs
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
