"""Every rank builds the same datasets; run by ``torchrun`` from tests/test_ddp.py.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/jobs/list_once.py OUT_DIR CONFIG

CONFIG: ``tag`` and ``cases`` (per case name, ``spec``, ``storage_options`` and, for an
``ObjectDataset``, ``kind``: "objects"). Writes
``OUT_DIR/{tag}-rank{R}.json``: per case, the shards (rows, and samples by the index) the
rank got, or the error type it raised.
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
        make = (sd.ObjectDataset if case.get("kind") == "objects" else
                sd.ParquetDataset if case["spec"].endswith(".parquet") else
                sd.ArrowDataset if case["spec"].endswith(".arrow") else sd.TarDataset)
        try:
            ds = make(case["spec"], storage_options=case["storage_options"])
            counts = ds.sample_counts() if hasattr(ds, "sample_counts") else None
            out[name] = {"shards": [s.url for s in ds.shards], "rows": getattr(ds, "num_rows", None),
                         "samples": None if counts is None else int(counts.sum())}
        except sd.StreamDataError as exc:
            out[name] = {"error": type(exc).__name__, "url": exc.url}
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
