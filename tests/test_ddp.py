"""Real ``torchrun`` jobs (2 ranks, gloo on CPU, 2 workers each) over uneven data: no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import UNEVEN, write_shards

JOB = Path(__file__).parent / "jobs" / "ddp_uneven.py"
TIME_LIMIT_S = 240  # a hang shows as this time limit, not as a hung suite

CASES = {  # the three cases: uneven, random 10-200, equal shards not a multiple of 4
    "uneven": UNEVEN,
    "random": [10, 200, 37, 150, 11, 99, 120, 13, 54, 180, 77, 61, 42],
    "equal17": [64] * 17,
}


def _torchrun(tmp_path: Path, cases: dict) -> dict[int, dict]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(JOB), str(tmp_path), json.dumps(cases)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the torchrun job hung (no end within {TIME_LIMIT_S} s): {exc.stderr!s:.2000}")
    assert done.returncode == 0, done.stderr[-3000:]
    return {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_ddp_over_uneven_shards_ends_every_epoch_together(s3_bucket, tmp_path):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    cases, keys = {}, {}
    for name, counts in CASES.items():
        keys[name] = write_shards(fs, f"{bucket}/{name}", counts=counts)
        cases[name] = {"spec": f"s3://{bucket}/{name}/shard-{{000..{len(counts) - 1:03d}}}.tar",
                       "storage_options": server.storage_options}
    ranks = _torchrun(tmp_path, cases)
    for name in CASES:
        for epoch in range(2):
            r0, r1 = (ranks[r][name][epoch] for r in (0, 1))
            assert r0["steps"] == r1["steps"] > 0 and r0["all_steps"] == [r0["steps"]] * 2, (name, epoch)
            delivered = r0["keys"] + r1["keys"]
            assert len(delivered) == len(set(delivered)) and set(delivered) <= set(keys[name])
            assert len(delivered) + r0["undelivered"] + r1["undelivered"] == len(keys[name]), (name, epoch)
