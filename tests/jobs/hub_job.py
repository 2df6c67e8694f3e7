"""A job reading a dataset on the Hugging Face Hub (``hf://``), run by ``torchrun`` from
tests/store/test_hub.py, against the loopback Hub that ``HF_ENDPOINT`` names (``HF_TOKEN`` its token).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/jobs/hub_job.py OUT_DIR CONFIG

CONFIG: ``tag``, ``spec`` and ``fetch`` (``sd.Fetch``'s fields). Each rank builds an
``sd.TarDataset`` (rank 0 lists: LIST-ONCE), reads one epoch with 2 DataLoader workers, and
writes ``OUT_DIR/{tag}-rank{R}.json``: the keys it read and the dataset's counters.
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
    ds = sd.TarDataset(cfg["spec"], index=None, fetch=sd.Fetch(**cfg.get("fetch", {})))
    with sd.loader(ds, batch_size=4, num_workers=2) as loader:
        keys = [k for batch in loader for k in batch["__key__"]]
    with open(f"{out_dir}/{cfg['tag']}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"keys": keys, "counts": dict(ds.counts)}, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
