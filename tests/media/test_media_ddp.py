"""sd.video under DDP (torchrun, 2 ranks x 2 workers): every video exactly once in an epoch,
and after a mid-epoch stop and a resume on another world size (1 rank, 1 worker) every video
exactly once over both runs, each with the clip the uninterrupted epoch gave it (IMAGE-SEED)."""

from __future__ import annotations

import collections
import uuid
from pathlib import Path

import pytest

from tests.helpers import tar_bytes, torchrun
from tests.media.synth import video_bytes

JOB = Path(__file__).parent.parent / "jobs" / "media_job.py"
COUNTS = [5, 3, 6, 4]  # 18 videos


@pytest.mark.slow
def test_torchrun_every_video_once_and_the_same_clips_after_an_elastic_resume(s3_server, tmp_path):
    import s3fs

    from streamdata.catalog.index import build_index

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    keys, n = [], 0
    for s, count in enumerate(COUNTS):
        samples = [{"__key__": f"v{n + i:03d}", "mp4": video_bytes(20 + n + i, gop=5, size=32)}
                   for i in range(count)]
        fs.pipe_file(f"{bucket}/vid/shard-{s:03d}.tar", tar_bytes(samples))
        keys += [x["__key__"] for x in samples]
        n += count
    spec = f"s3://{bucket}/vid/shard-{{000..{len(COUNTS) - 1:03d}}}.tar"
    build_index(spec, s3_server.storage_options, progress=False)  # an exact epoch, an exact resume
    base = {"spec": spec, "storage_options": s3_server.storage_options, "workers": 2}
    state = str(tmp_path / "state.json")

    whole = torchrun(JOB, tmp_path, 2, {**base, "tag": "whole"})
    clips = {k: v for r in whole for k, v in r["clips"].items()}
    assert sorted(clips) == keys and sum(len(r["clips"]) for r in whole) == len(keys)  # exactly once
    assert whole[0]["steps"] == whole[1]["steps"]

    first = torchrun(JOB, tmp_path, 2, {**base, "tag": "first", "stop": 2, "save": state})
    rest = torchrun(JOB, tmp_path, 1, {**base, "tag": "rest", "load": state, "workers": 1})
    got = collections.Counter(k for r in first + rest for k in r["clips"])
    assert sorted(got) == keys and max(got.values()) == 1
    assert all(clips[k] == v for r in first + rest for k, v in r["clips"].items())
