"""sd.video under DDP (torchrun, 2 ranks x 2 workers): every video exactly once in an epoch,
and after a mid-epoch stop and a resume on another world size (1 rank, 1 worker) every video
exactly once over both runs, each with the clip the uninterrupted epoch gave it (IMAGE-SEED)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import once_after_a_resume, s3_tar_shards
from tests.media.synth import video_bytes

JOB = Path(__file__).parent.parent / "jobs" / "media_job.py"
COUNTS = [5, 3, 6, 4]  # 18 videos


@pytest.mark.slow
def test_torchrun_every_video_once_and_the_same_clips_after_an_elastic_resume(s3_server, tmp_path):
    spec, keys = s3_tar_shards(s3_server, "vid", COUNTS,
                               lambda n: {"__key__": f"v{n:03d}", "mp4": video_bytes(20 + n, gop=5, size=32)})
    base = {"spec": spec, "storage_options": s3_server.storage_options, "workers": 2}
    once_after_a_resume(JOB, tmp_path, base, keys, "clips", 1, {"workers": 1})
