"""A DDP job over tar shards of videos through ``sd.video``; run by ``torchrun`` from
tests/media/test_media_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/media_job.py OUT_DIR CONFIG_JSON

CONFIG: ``spec``, ``storage_options``, ``workers``, ``tag`` and ``stop`` (the step after which
every rank takes ``loader.state_dict()``, rank 0 writing it to ``save``) or ``load`` (a state to
resume from). Each rank trains a tiny DDP model (gloo, CPU) on the clips of epoch 1 and writes
``OUT_DIR/{tag}-rank{R}.json``: its steps and, per key it delivered, its clip's frame times.
"""

from __future__ import annotations

import json
import sys

import torch

import streamdata as sd
from tests.helpers import ddp_job, ddp_steps
from tests.jobs._leave import leave


def _features(batch) -> torch.Tensor:
    return batch["mp4"]["frames"].float().flatten(1)[:, :8]


def main(out_dir: str, config_json: str) -> None:
    cfg, rank, model, optimizer = ddp_job(config_json)
    ds = sd.TarDataset(cfg["spec"], storage_options=cfg["storage_options"], seed=3, shuffle=True,
                       decode=sd.video.RandomClip(frames=3, stride=2, size=16))
    clips: dict[str, list[float]] = {}
    steps = 0
    with sd.loader(ds, batch_size=2, num_workers=cfg["workers"]) as loader:
        loader.set_epoch(1)
        for batch in ddp_steps(loader, model, optimizer, _features, cfg, rank):
            steps += 1
            assert batch["mp4"]["frames"].dtype == torch.uint8
            assert tuple(batch["mp4"]["frames"].shape[1:]) == (3, 3, 16, 16)
            for key, pts in zip(batch["__key__"], batch["mp4"]["pts"], strict=True):
                assert key not in clips, key
                clips[key] = pts.tolist()
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump({"steps": steps, "clips": clips}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
