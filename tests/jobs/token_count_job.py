"""Every rank builds the same ``sd.TokenDataset`` over tar shards of ``.npy`` tokens without kept
counts; run by ``torchrun`` from tests/test_tokens_ddp.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/token_count_job.py OUT_DIR CONFIG

CONFIG: ``tag`` and ``cases`` (per case name, ``spec`` and ``options``, the dataset's keyword
arguments, and optionally ``endpoints``: per rank, the ``endpoint_url`` it reads through).
Writes ``OUT_DIR/{tag}-rank{R}.json``: per case, the shards the job's counting pass read
(``counted``) and those this rank read (``here``, COUNT-SHARED), the tokens, and each shard's
tokens per sample and byte offsets; or the error the rank raised.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch.distributed as dist

import streamdata as sd
from tests.jobs._leave import leave


def main(out_dir: str, config_json: str) -> None:
    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out = {}
    for name, case in cfg["cases"].items():
        options = dict(case["options"])
        if "endpoints" in case:  # each rank through an endpoint of its own (a proxy that counts its requests)
            options["storage_options"] = {**options["storage_options"],
                                          "endpoint_url": case["endpoints"][dist.get_rank()]}
        try:
            ds = sd.TokenDataset(case["spec"], **options)
            out[name] = {"counted": ds.counted_shards, "here": ds.counted_here, "tokens": ds.num_tokens,
                         "counts": [c.tolist() for c, _ in ds.token_layout.counted],
                         "offsets": [o.tolist() for _, o in ds.token_layout.counted]}
        except sd.StreamDataError as exc:
            out[name] = {"error": type(exc).__name__, "url": exc.url, "message": str(exc)}
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
