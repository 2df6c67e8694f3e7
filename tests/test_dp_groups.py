"""Data-parallel groups under real ``torchrun`` (gloo, CPU): 4 ranks as 2 replicas of 2
(tensor parallelism's layout), the ranks of a replica fed identical batches, the replicas
splitting each epoch exactly; a stop mid-epoch resumed on 2 ranks as 1 replica of 2.
The job: tests/jobs/dp_groups_job.py. docs/frameworks.md's DeviceMesh loop (TP inside each replica,
FSDP2 across them): tests/jobs/mesh_job.py."""

from __future__ import annotations

import collections
import json
import uuid
from pathlib import Path

import pytest

from tests.helpers import doc_blocks, torchrun, write_shards, write_tables

JOB = Path(__file__).parent / "jobs" / "dp_groups_job.py"
TIME_LIMIT_S = 240
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17]  # tar: 113 samples
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1], [20, 11], [30, 8, 2]]  # 136 rows
# case: (format, how the place is given)
WHOLE = {"args": ("tar", "args"), "mesh": ("parquet", "mesh"), "group": ("tar", "group"),
         "dataset": ("tar", "dataset"), "accelerate": ("parquet", "accelerate"),
         "megatron": ("tar", "megatron")}
# (LAUNCHER-PLACE: the place found, none given; megatron after the other such: its state stays)
STOPPED = {"tar-stop": ("tar", "args", 5), "parquet-stop": ("parquet", "mesh", 7)}  # ... and its stop


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    """The whole epochs and the stopped runs on 4 ranks (TP=2 x DP=2), the restarts on 2 (TP=2 x
    DP=1): ``(everything, first run, restarted run, saved states)``."""
    import s3fs

    from streamdata.catalog.index import build_index

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    tmp_path = tmp_path_factory.mktemp("dp-groups")
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
        everything = {"tar": write_shards(fs, f"{bucket}/tar", counts=COUNTS),
                      "parquet": write_tables(fs, f"{bucket}/parquet", ROW_GROUPS, "parquet")}
        build_index(f"s3://{bucket}/tar/", storage_options=s3_server.storage_options, progress=False)

        def case(kind: str, how: str) -> dict:
            return {"kind": kind, "how": how, "spec": f"s3://{bucket}/{kind}/",
                    "storage_options": s3_server.storage_options}

        first = torchrun(JOB, tmp_path, 4, {"tag": "first", "tp": 2, "workers": 2, "cases": {
            **{name: case(kind, how) for name, (kind, how) in WHOLE.items()},
            **{name: {**case(kind, how), "stop": stop, "save": str(tmp_path / f"{name}.json")}
               for name, (kind, how, stop) in STOPPED.items()}}}, TIME_LIMIT_S)
        after = torchrun(JOB, tmp_path, 2, {"tag": "after", "tp": 2, "workers": 1, "cases": {
            name: {**case(kind, how), "load": str(tmp_path / f"{name}.json")}
            for name, (kind, how, _) in STOPPED.items()}}, TIME_LIMIT_S)
        saved = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in STOPPED}
        yield everything, first, after, saved
    finally:
        s3_server.delete_bucket(bucket)


def _replica_keys(run: list[dict], name: str, tp: int) -> list:
    """Every key the replicas delivered: one rank of each replica (its first)."""
    return [k for r in run[::tp] for step in r[name]["steps"] for k in step]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WHOLE))
def test_ranks_of_a_replica_see_the_same_batches_and_replicas_split_the_epoch(runs, name):
    everything, first, _, _ = runs
    steps = [r[name]["steps"] for r in first]
    assert steps[0] == steps[1] and steps[2] == steps[3], "the ranks of a replica got different batches"
    assert steps[0] != steps[2], "the two replicas got the same batches"
    assert [r[name]["place"] for r in first] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    counts = [len(s) for s in steps]
    assert len(set(counts)) == 1 and first[0][name]["all_steps"] == counts, f"unequal steps {counts}"
    got = collections.Counter(_replica_keys(first, name, 2))
    want = everything[WHOLE[name][0]]
    assert sorted(got) == sorted(want), "samples lost"
    assert max(got.values()) == 1, f"duplicates {[k for k, n in got.items() if n > 1]}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STOPPED))
def test_a_stop_on_two_replicas_resumes_exactly_on_one(runs, name):
    everything, first, after, saved = runs
    kind, _, stop = STOPPED[name]
    assert [len(r[name]["steps"]) for r in first] == [stop] * 4
    assert saved[name]["split"] == "samples"
    before = _replica_keys(first, name, 2)
    assert sum(saved[name]["stages"][-1]["delivered"]) == len(before)
    resumed = [r[name]["steps"] for r in after]
    assert resumed[0] == resumed[1], "the ranks of the one replica got different batches after the resume"
    got = collections.Counter(before + _replica_keys(after, name, 2))
    assert sorted(got) == sorted(everything[kind]), "samples lost across the resume"
    assert max(got.values()) == 1, f"duplicates {[k for k, n in got.items() if n > 1]}"


MESH_JOB = Path(__file__).parent / "jobs" / "mesh_job.py"
MESH_HEADING = "A DeviceMesh loop (torchtitan-style)"


def test_the_pages_devicemesh_loop_is_the_job():
    text = MESH_JOB.read_text()
    start = text.index("\n", text.index(f"# --- recipe: docs/frameworks.md, {MESH_HEADING} ---")) + 1
    recipe = text[start:text.index("# --- end of recipe ---")].strip()
    assert doc_blocks("docs/frameworks.md", f"## {MESH_HEADING}")[0].strip() == recipe


@pytest.mark.slow
def test_the_devicemesh_loop_feeds_tp_peers_alike_and_splits_over_replicas(s3_server, tmp_path):
    """docs/frameworks.md's loop on 4 ranks, DP=2 x TP=2 (parallelize_module over mesh["tp"],
    fully_shard over mesh["dp"], sd.loader(mesh=mesh["dp"])), two epochs: the TP peers of a replica
    train the same batches step by step, the replicas different ones, every sample once per epoch."""
    import s3fs

    from streamdata.catalog.index import build_index

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
        everything = write_shards(fs, f"{bucket}/tar", counts=COUNTS)
        build_index(f"s3://{bucket}/tar/", storage_options=s3_server.storage_options, progress=False)
        cfg = {"tag": "mesh", "spec": f"s3://{bucket}/tar/", "storage_options": s3_server.storage_options,
               "dp": 2, "tp": 2}
        ranks = torchrun(MESH_JOB, tmp_path, 4, cfg, TIME_LIMIT_S)
    finally:
        s3_server.delete_bucket(bucket)
    assert [r["place"] for r in ranks] == [[0, 0], [0, 1], [1, 0], [1, 1]]  # dp outermost, tp innermost
    for epoch in ("0", "1"):
        steps = [r["steps"][epoch] for r in ranks]
        assert steps[0] == steps[1] and steps[2] == steps[3], f"epoch {epoch}: TP peers got different batches"
        assert steps[0] != steps[2], f"epoch {epoch}: the two replicas got the same batches"
        assert len({len(s) for s in steps}) == 1, f"epoch {epoch}: unequal steps {[len(s) for s in steps]}"
        got = collections.Counter(k for r in ranks[::2] for step in r["steps"][epoch] for k in step)
        assert sorted(got) == sorted(everything), f"epoch {epoch}: samples lost"
        assert max(got.values()) == 1, f"epoch {epoch}: duplicates {[k for k, n in got.items() if n > 1]}"
