"""Real ``torchrun`` resume (gloo on CPU, the S3 test server, uneven shards with an index): a
2 ranks x 2 workers job stops at a seeded step and saves ``sd.loader``'s state (every rank's
positions); it restarts on (a) the same world, (b) 3 ranks x 1 worker, (c) 1 rank x 0 workers.
Before + after = the epoch exactly, no duplicate, the same number of steps on every rank (a
shuffle buffer of 16 on: RESUME-BUFFER and its elastic replay; or the block shuffle, window 8:
BLOCK-SHUFFLE)."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import write_shards

JOB = Path(__file__).parent / "jobs" / "resume_job.py"
TIME_LIMIT_S = 240
COUNTS = [5, 1, 9, 3, 0, 7, 2, 20, 11, 30, 8, 17]  # 113 samples


def _torchrun(tmp_path: Path, nproc: int, cfg: dict) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(JOB), str(tmp_path), json.dumps(cfg)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the torchrun job hung (no end within {TIME_LIMIT_S} s): {exc.stderr!s:.2000}")
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((tmp_path / f"{cfg['tag']}-rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", ["buffer", "block"])
def test_torchrun_resume_on_the_same_and_other_worlds(s3_bucket, tmp_path, shuffle):
    import s3fs

    from streamdata.index import build_index

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    everything = write_shards(fs, f"{bucket}/rs", counts=COUNTS)
    build_index(f"s3://{bucket}/rs/", storage_options=server.storage_options, progress=False)
    base = {"spec": f"s3://{bucket}/rs/", "storage_options": server.storage_options, "shuffle": shuffle}
    stop = random.Random(13).randint(2, 10)  # of 15 steps per rank
    state = tmp_path / "state.json"
    first = _torchrun(tmp_path, 2, {**base, "workers": 2, "tag": "first", "stop": stop, "save": str(state)})
    assert [r["steps"] for r in first] == [stop, stop]
    before = [k for r in first for k in r["keys"]]
    saved = json.loads(state.read_text())
    delivered = saved["stages"][-1]["delivered"]  # every rank's readers, gathered by rank 0
    assert None not in delivered and sum(delivered) == len(before)
    for tag, nproc, workers in (("same", 2, 2), ("three", 3, 1), ("one", 1, 0)):
        after = _torchrun(tmp_path, nproc, {**base, "workers": workers, "tag": tag, "load": str(state)})
        steps = [r["steps"] for r in after]
        assert len(set(steps)) == 1 and after[0]["all_steps"] == steps, f"{tag}: unequal steps {steps}"
        got = collections.Counter(before + [k for r in after for k in r["keys"]])
        assert sorted(got) == sorted(everything), f"{tag}: samples lost"
        assert max(got.values()) == 1, f"{tag}: duplicates {[k for k, n in got.items() if n > 1]}"
