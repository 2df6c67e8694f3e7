"""A DDP job over JPEG shards through the fast image path; run by ``torchrun`` from
tests/test_images_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/images_job.py OUT_DIR CONFIG_JSON

CONFIG: ``spec``, ``storage_options``, ``workers``, ``threads`` (decode_threads), ``parquet``
(the spec is Hugging Face-style Parquet with an ``image`` column and an ``id`` column, decoded by
type with ``decode=``; a skipped row is one that failed to decode), ``on_error``, ``tag`` and
``stop`` (the step after which every rank takes ``loader.state_dict()``, rank 0 writing it to
``save``) or ``load`` (a state to resume from). Each rank trains a tiny DDP model (gloo, CPU) on
the images of epoch 1 and writes ``OUT_DIR/{tag}-rank{R}.json``: its steps and, per key it
delivered, a digest of the image it got.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

import streamdata as sd
from tests.helpers import ddp_job, ddp_steps
from tests.jobs._leave import leave


def _features(batch) -> torch.Tensor:
    return batch[_field(batch)].float().flatten(1)[:, :8]


def _field(batch) -> str:
    return "image" if "image" in batch else "jpg"


def _dataset(cfg: dict):
    crop = sd.images.RandomResizedCrop(16)
    common = {"storage_options": cfg["storage_options"], "seed": 3, "shuffle": True,
              "on_error": cfg.get("on_error", "raise")}
    if cfg.get("parquet"):
        return sd.ParquetDataset(cfg["spec"], decode=crop, **common)
    return sd.TarDataset(cfg["spec"], decode=crop, decode_threads=cfg["threads"], **common)


def main(out_dir: str, config_json: str) -> None:
    cfg, rank, model, optimizer = ddp_job(config_json)
    ds = _dataset(cfg)
    images: dict[str, str] = {}
    steps = 0
    with sd.loader(ds, batch_size=4, num_workers=cfg["workers"]) as loader:
        loader.set_epoch(1)
        for batch in ddp_steps(loader, model, optimizer, _features, cfg, rank):
            steps += 1
            field = _field(batch)
            assert batch[field].dtype == torch.uint8 and tuple(batch[field].shape[1:]) == (3, 16, 16)
            keys = batch["__key__"] if field == "jpg" else [f"img{int(i):04d}" for i in batch["id"]]
            for key, image in zip(keys, batch[field], strict=True):
                assert key not in images, key
                images[key] = hashlib.sha1(image.numpy().tobytes()).hexdigest()
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump({"steps": steps, "images": images, "skipped": dict(ds.skipped)}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
