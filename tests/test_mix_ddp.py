"""Real ``torchrun`` resume of a tar (with an index) + Parquet ``sd.Mix`` on the S3 test server
(gloo on CPU): 2 ranks x 2 workers stop at a seeded step and save ``sd.loader``'s state (every
rank's positions); the job restarts on (a) 2 x 2, (b) 3 x 1, (c) 1 x 0. Each source's epoch is
delivered exactly once over the two runs (``stop="all"``: every sample, and the extra copies are
the counted cycles; ``stop="first"``: no duplicate, and what was not delivered is counted), with
the same number of steps on every rank in each run. With an ``sd.Schedule`` of weights, the same:
and each rank's samples after a restart on the same world are the rest of its uninterrupted run."""

from __future__ import annotations

import collections
import json
import random
from pathlib import Path

import pytest

from tests.helpers import torchrun, write_shards, write_tables

JOB = Path(__file__).parent / "jobs" / "mix_job.py"
TIME_LIMIT_S = 240
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17]  # 113 tar samples
ROW_GROUPS = [[5, 1, 9], [3], [7, 2], [13, 4, 4], [1], [6, 6, 3, 1], [12, 5]]  # 82 rows
TOTAL = [113, 82]


def _torchrun(tmp_path: Path, nproc: int, cfg: dict) -> list[dict]:
    return torchrun(JOB, tmp_path, nproc, cfg, TIME_LIMIT_S)


def _sources(s3_bucket, mode: str) -> dict:
    import s3fs

    from streamdata.catalog.index import build_index

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/tar", counts=COUNTS)
    build_index(f"s3://{bucket}/tar/", storage_options=server.storage_options, progress=False)
    write_tables(fs, f"{bucket}/pq", ROW_GROUPS)
    return {"tar": f"s3://{bucket}/tar/", "parquet": f"s3://{bucket}/pq/",
            "storage_options": server.storage_options, "mode": mode}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["all", "first"])
def test_torchrun_mix_resumes_on_the_same_and_other_worlds(s3_bucket, tmp_path, mode):
    base = _sources(s3_bucket, mode)
    stop = random.Random(17).randint(3, 15)  # of about 24 steps per rank
    state = tmp_path / "state.json"
    first = _torchrun(tmp_path, 2, {**base, "workers": 2, "tag": "first", "stop": stop, "save": str(state)})
    assert [r["steps"] for r in first] == [stop, stop]
    before = [tuple(p) for r in first for p in r["pairs"]]
    saved = json.loads(state.read_text())
    entries = saved["stages"][-1]["delivered"]  # every rank's readers, gathered by rank 0
    assert None not in entries and sum(e["t"] for e in entries) == len(before)
    for tag, nproc, workers in (("same", 2, 2), ("three", 3, 1), ("one", 1, 0)):
        after = _torchrun(tmp_path, nproc, {**base, "workers": workers, "tag": tag, "load": str(state)})
        steps = [r["steps"] for r in after]
        assert len(set(steps)) == 1 and after[0]["all_steps"] == steps, f"{tag}: unequal steps {steps}"
        assert steps[0] > 0
        got = before + [tuple(p) for r in after for p in r["pairs"]]
        runs = first + after
        for k, total in enumerate(TOTAL):
            seen = collections.Counter(i for s, i in got if s == k)
            counted = lambda name: sum(r["counts"][f"mix.{name}.{k}"] for r in runs)  # noqa: B023, E731
            if mode == "all":
                assert set(seen) == set(range(total)), f"{tag}: source {k} lost samples"
                assert sum(seen.values()) == total + counted("cycled"), f"{tag}: source {k} repeats"
            else:
                assert max(seen.values()) == 1, f"{tag}: source {k} duplicates"
                assert set(seen) <= set(range(total))
                assert sum(seen.values()) + counted("undelivered") == total, f"{tag}: source {k} lost"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["mid", "end"])
def test_torchrun_scheduled_mix_resumes_mid_schedule(s3_bucket, tmp_path, where):
    """stop="first" with weights from 2:1 to 1:3 over the epoch: 2 ranks x 2 workers stop at a
    seeded step in the epoch's first half, or two steps before its end (the workers may have
    ended their passes ahead of the loop: the counts follow the batches received); on 2 x 2
    each rank delivers the rest of its uninterrupted run; on 3 x 1 each source's epoch at most
    once over the two runs, the rest counted, with equal steps."""
    base = {**_sources(s3_bucket, "first"), "schedule": True}
    whole = _torchrun(tmp_path, 2, {**base, "workers": 2, "tag": "whole"})
    assert len({r["steps"] for r in whole}) == 1
    src = [sum(1 for s, _ in r["pairs"] if s == 1) / len(r["pairs"]) for r in whole]
    assert all(0.4 < share < 0.6 for share in src), src  # (1/3 to 3/4 over the epoch: about half)
    stop = random.Random(23).randint(3, whole[0]["steps"] // 2) if where == "mid" else whole[0]["steps"] - 2
    state = tmp_path / "state.json"
    first = _torchrun(tmp_path, 2, {**base, "workers": 2, "tag": "first", "stop": stop, "save": str(state)})
    same = _torchrun(tmp_path, 2, {**base, "workers": 2, "tag": "same", "load": str(state)})
    for r in range(2):
        assert first[r]["steps"] + same[r]["steps"] == whole[r]["steps"]
        assert collections.Counter(map(tuple, first[r]["pairs"] + same[r]["pairs"])) == collections.Counter(
            map(tuple, whole[r]["pairs"])), f"rank {r}: not the uninterrupted run's samples"
    three = _torchrun(tmp_path, 3, {**base, "workers": 1, "tag": "three", "load": str(state)})
    assert len({r["steps"] for r in three}) == 1 and three[0]["steps"] > 0
    got = [tuple(p) for r in first + three for p in r["pairs"]]
    for k, total in enumerate(TOTAL):
        seen = collections.Counter(i for s, i in got if s == k)
        assert max(seen.values()) == 1, f"source {k} duplicates"
        assert set(seen) <= set(range(total))
        undelivered = sum(r["counts"][f"mix.undelivered.{k}"] for r in first + three)
        assert sum(seen.values()) + undelivered == total, f"source {k} lost"
