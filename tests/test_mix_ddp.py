"""Real ``torchrun`` resume of a tar (with an index) + Parquet ``sd.Mix`` on the S3 test server
(gloo on CPU): 2 ranks x 2 workers stop at a seeded step and save ``sd.loader``'s state (every
rank's positions); the job restarts on (a) 2 x 2, (b) 3 x 1, (c) 1 x 0. Each source's epoch is
delivered exactly once over the two runs (``stop="all"``: every sample, and the extra copies are
the counted cycles; ``stop="first"``: no duplicate, and what was not delivered is counted), with
the same number of steps on every rank in each run."""

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


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["all", "first"])
def test_torchrun_mix_resumes_on_the_same_and_other_worlds(s3_bucket, tmp_path, mode):
    import s3fs

    from streamdata.catalog.index import build_index

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    write_shards(fs, f"{bucket}/tar", counts=COUNTS)
    build_index(f"s3://{bucket}/tar/", storage_options=server.storage_options, progress=False)
    write_tables(fs, f"{bucket}/pq", ROW_GROUPS)
    base = {"tar": f"s3://{bucket}/tar/", "parquet": f"s3://{bucket}/pq/",
            "storage_options": server.storage_options, "mode": mode}
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
