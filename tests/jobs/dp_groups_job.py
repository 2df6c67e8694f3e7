"""A job whose ranks form data-parallel replicas of a model split across ranks (tensor or context
parallelism): run by ``torchrun`` from tests/test_dp_groups.py.

    python -m torch.distributed.run --nproc_per_node=N tests/jobs/dp_groups_job.py OUT_DIR CONFIG_JSON

CONFIG: ``tag``, ``tp`` (ranks per replica: consecutive global ranks), ``workers`` and ``cases``:
per case name, ``kind`` ("tar" or "parquet"), ``spec``, ``storage_options``, ``how`` ("args":
``dp_rank``/``dp_size``; "mesh": a 2-D ``DeviceMesh`` ("dp", "tp") and its "dp" dimension;
"group": the data-parallel process group; "dataset": ``dp_rank``/``dp_size`` given to the
dataset, not the loader; "megatron": none given, Megatron's ``parallel_state`` initialised with
``tp``; "accelerate": none given, the variables ``accelerate launch --parallelism_config_tp_size``
exports set for the case), and ``stop``/``save`` or ``load`` as in ``resume_job``. Each rank writes
``OUT_DIR/{tag}-rank{R}.json``: per case, its batches' keys step by step and every rank's steps.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import streamdata as sd
from tests.helpers import ddp_steps
from tests.jobs._leave import leave
from tests.jobs.resume_job import _features, _keys

DATASETS = {"tar": sd.TarDataset, "parquet": sd.ParquetDataset}


def _place(how: str, tp: int, groups: list) -> dict:
    """The data-parallel place as the case gives it: replicas of ``tp`` consecutive ranks."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if how in ("args", "dataset"):
        return {"dp_rank": rank // tp, "dp_size": size // tp}
    if how == "megatron":
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                     distributed_timeout_minutes=1)
        return {}
    if how == "accelerate":
        os.environ.update(ACCELERATE_USE_PARALLELISM_CONFIG="true", PARALLELISM_CONFIG_TP_SIZE=str(tp),
                          PARALLELISM_CONFIG_DP_SHARD_SIZE=str(size // tp))
        return {}
    if how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (size // tp, tp), mesh_dim_names=("dp", "tp"))
        return {"mesh": mesh["dp"]}
    return {"group": groups[rank % tp]}  # the ranks at this rank's place in every replica


def run_case(case: dict, cfg: dict, groups: list) -> dict:
    rank, tp = dist.get_rank(), cfg["tp"]
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    place = _place(case["how"], tp, groups)
    on_dataset = place if case["how"] == "dataset" else {}
    ds = DATASETS[case["kind"]](case["spec"], storage_options=case["storage_options"], seed=5, shuffle=True,
                                **on_dataset)
    steps: list[list] = []
    with sd.loader(ds, batch_size=4, num_workers=cfg["workers"], **({} if on_dataset else place)) as loader:
        loader.set_epoch(2)
        for batch in ddp_steps(loader, model, optimizer, _features, case, rank):
            steps.append(_keys(batch))
    for name in ("ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_TP_SIZE",
                 "PARALLELISM_CONFIG_DP_SHARD_SIZE"):
        os.environ.pop(name, None)
    all_steps: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_steps, len(steps))
    place = ds.data_parallel
    return {"steps": steps, "all_steps": all_steps,
            "place": None if place is None else [place.rank, place.size]}


def main(out_dir: str, config_json: str) -> None:
    cfg = json.loads(config_json)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, size, tp = dist.get_rank(), dist.get_world_size(), cfg["tp"]
    # every rank takes part in making every group; each uses the one at its place in its replica
    groups = [dist.new_group([r for r in range(size) if r % tp == t], backend="gloo") for t in range(tp)]
    results = {name: run_case(case, cfg, groups) for name, case in cfg["cases"].items()}
    with open(f"{out_dir}/{cfg['tag']}-rank{rank}.json", "w") as f:
        json.dump(results, f)
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:3])
