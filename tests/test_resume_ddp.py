"""Real ``torchrun`` resume (gloo on CPU, the S3 test server): a 2 ranks x 2 workers job stops
at a seeded step and saves ``sd.loader``'s state (every rank's positions); it restarts on (a)
the same world, (b) 3 ranks x 1 worker, (c) 1 rank x 0 workers. Before + after = the epoch
exactly, no duplicate, the same number of steps on every rank. One set of launches reads every
format, one after the other (a torchrun start costs seconds): uneven tar shards with an index
and uneven Parquet row groups, both behind a shuffle buffer of 16 (RESUME-BUFFER and its
elastic replay), Arrow IPC files with uneven record batches without a buffer (seeks), and the
tar shards again under the block shuffle (window 8: BLOCK-SHUFFLE)."""

from __future__ import annotations

import collections
import json
import random
import uuid
from pathlib import Path

import pytest

from tests.helpers import torchrun, write_shards, write_tables

JOB = Path(__file__).parent / "jobs" / "resume_job.py"
TIME_LIMIT_S = 240
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17]  # tar: 113 samples
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1], [20, 11], [30, 8, 2]]  # 136 rows
BATCHES = [[9, 2], [5], [17, 1, 6], [3, 30], [12, 4, 4, 8], [7]]  # Arrow IPC files: 108 rows
# case: (format, its shuffle buffer, or "block": the block shuffle, window 8: BLOCK-SHUFFLE)
KINDS = {"tar": ("tar", 16), "parquet": ("parquet", 16), "arrow": ("arrow", 0), "tar-block": ("tar", "block")}
WORLDS = (("same", 2, 2), ("three", 3, 1), ("one", 1, 0))  # tag, ranks, workers


def _torchrun(tmp_path: Path, nproc: int, cfg: dict) -> list[dict]:
    return torchrun(JOB, tmp_path, nproc, cfg, TIME_LIMIT_S)


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    """Every format's data on one bucket; the stopped run and the three restarts, launched once
    for all formats: ``{kind: (everything, saved state, first run, {tag: restarted run})}``."""
    import s3fs

    from streamdata.catalog.index import build_index

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    tmp_path = tmp_path_factory.mktemp("resume-ddp")
    try:
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
        everything = {"tar": write_shards(fs, f"{bucket}/tar", counts=COUNTS),
                      "parquet": write_tables(fs, f"{bucket}/parquet", ROW_GROUPS, "parquet"),
                      "arrow": write_tables(fs, f"{bucket}/arrow", BATCHES, "arrow")}
        everything["tar-block"] = everything["tar"]
        build_index(f"s3://{bucket}/tar/", storage_options=s3_server.storage_options, progress=False)
        options = s3_server.storage_options
        cases = {name: {"kind": kind, "spec": f"s3://{bucket}/{kind}/", "shuffle_buffer": buffer,
                        "storage_options": options} for name, (kind, buffer) in KINDS.items()}
        stops = {kind: random.Random(13 + i).randint(2, 10) for i, kind in enumerate(KINDS)}  # of 14-17
        first = _torchrun(tmp_path, 2, {"workers": 2, "tag": "first", "cases": {
            kind: {**case, "stop": stops[kind], "save": str(tmp_path / f"{kind}-state.json")}
            for kind, case in cases.items()}})
        after = {tag: _torchrun(tmp_path, nproc, {"workers": workers, "tag": tag, "cases": {
            kind: {**case, "load": str(tmp_path / f"{kind}-state.json")} for kind, case in cases.items()}})
            for tag, nproc, workers in WORLDS}
        saved = {kind: json.loads((tmp_path / f"{kind}-state.json").read_text()) for kind in KINDS}
        yield {kind: (everything[kind], stops[kind], saved[kind], [r[kind] for r in first],
                      {tag: [r[kind] for r in run] for tag, run in after.items()}) for kind in KINDS}
    finally:
        s3_server.delete_bucket(bucket)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_torchrun_resume_on_the_same_and_other_worlds(runs, kind):
    everything, stop, saved, first, after = runs[kind]
    assert [r["steps"] for r in first] == [stop, stop]
    before = [k for r in first for k in r["keys"]]
    assert saved["split"] == "samples"  # a sample-level position: the exact resume
    delivered = saved["stages"][-1]["delivered"]  # every rank's readers, gathered by rank 0
    assert None not in delivered and sum(delivered) == len(before)
    for tag, nproc, _ in WORLDS:
        steps = [r["steps"] for r in after[tag]]
        assert len(steps) == nproc and len(set(steps)) == 1 and after[tag][0]["all_steps"] == steps, \
            f"{tag}: unequal steps {steps}"
        got = collections.Counter(before + [k for r in after[tag] for k in r["keys"]])
        assert sorted(got) == sorted(everything), f"{tag}: samples lost"
        assert max(got.values()) == 1, f"{tag}: duplicates {[k for k, n in got.items() if n > 1]}"
