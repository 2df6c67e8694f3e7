"""A DDP job over a tar + Parquet ``sd.Mix`` that stops mid-epoch and saves, or resumes; run by
``torchrun`` from tests/test_mix_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/mix_job.py OUT_DIR CONFIG_JSON

CONFIG: ``tar``, ``parquet`` (specs), ``storage_options``, ``workers``, ``tag``, ``schedule``
(true: weights from ``SCHEDULE``, else 2:1), and ``stop`` (the step after which every rank calls
``loader.state_dict()``, a collective; rank 0 writes it to ``save``), ``load``, or neither. Each
rank trains a tiny DDP model (gloo, CPU) and writes ``OUT_DIR/{tag}-rank{R}.json``: its steps,
every rank's steps, the (source, id) pairs it delivered and its mix counters.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import streamdata as sd
from tests.helpers import ddp_job, ddp_steps
from tests.jobs._leave import leave

SCHEDULE = [(0.0, [2.0, 1.0]), (1.0, [1.0, 3.0])]  # the Parquet source from 1/3 to 3/4 over the epoch


def tar_row(sample):
    return {"src": 0, "id": int(sample["__key__"][1:]), "x": torch.as_tensor(sample["npy"][:4])}


def pq_row(row):
    return {"src": 1, "id": int(row["id"]), "x": torch.full((4,), float(row["id"]))}


def main(out_dir: str, config_json: str) -> None:
    cfg, rank, model, optimizer = ddp_job(config_json, 4)
    options = cfg["storage_options"]
    mix = sd.Mix([sd.TarDataset(cfg["tar"], storage_options=options, shuffle=True, seed=3, map=tar_row),
                  sd.ParquetDataset(cfg["parquet"], storage_options=options, shuffle=True, seed=4,
                                    map=pq_row)],
                 weights=sd.Schedule(SCHEDULE) if cfg.get("schedule") else [2, 1], seed=5, stop=cfg["mode"])
    pairs, steps = [], 0
    with sd.loader(mix, batch_size=4, num_workers=cfg["workers"]) as loader:
        loader.set_epoch(1)
        for batch in ddp_steps(loader, model, optimizer, lambda b: b["x"].float(), cfg, rank):
            steps += 1
            pairs += list(zip(batch["src"].tolist(), batch["id"].tolist(), strict=True))
    all_steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_steps, steps)
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump({"steps": steps, "all_steps": all_steps, "pairs": pairs, "counts": mix.counts}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
