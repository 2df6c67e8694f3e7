"""The fast image path under DDP (torchrun, 2 ranks): every image exactly once in an epoch, and
after a mid-epoch stop and resume every image exactly once over both runs, each with the crop
the uninterrupted epoch gave it (IMAGE-SEED in ``formats/images.py``); for tar shards and for a
Hugging Face-style Parquet export decoded by its image column's type, with a corrupt cell skipped."""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import once_after_a_resume, s3_tar_shards

JOB = Path(__file__).parent / "jobs" / "images_job.py"
COUNTS = [9, 4, 12, 7, 6, 10]  # 48 images


def _jpeg(n: int) -> bytes:
    rng = np.random.default_rng(n)
    pixels = rng.integers(0, 256, (60 + n % 7, 80 + n % 5, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


@pytest.mark.slow
def test_torchrun_every_image_once_and_the_same_crops_after_a_resume(s3_server, tmp_path):
    spec, keys = s3_tar_shards(s3_server, "img", COUNTS,
                               lambda n: {"__key__": f"img{n:04d}", "jpg": _jpeg(n), "cls": b"1"})
    base = {"spec": spec, "storage_options": s3_server.storage_options, "workers": 1, "threads": 2}
    once_after_a_resume(JOB, tmp_path, base, keys, "images", 2, {"workers": 2, "threads": 1})


@pytest.mark.slow
def test_torchrun_hugging_face_parquet_images_once_equal_steps_and_a_counted_bad_row(s3_server, tmp_path):
    """A Hub-style Parquet export (``struct<bytes, path>`` image column) decoded by type on 2 ranks:
    every good image once, one corrupt cell skipped and counted on the rank that read it, every
    rank the same number of steps; a resume from a mid-epoch stop gives the rest with the same crops."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    bucket = f"sd-test-{uuid.uuid4().hex[:12]}"
    s3_server.create_bucket(bucket)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.storage_options)
    cell = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    bad, n = 13, 0
    for f, count in enumerate(COUNTS):
        ids = list(range(n, n + count))
        cells = [{"bytes": b"\xff\xd8\xff\xe0 not a jpeg" if i == bad else _jpeg(i), "path": f"{i}.jpg"}
                 for i in ids]
        table = pa.table({"image": pa.array(cells, cell),
                          "id": pa.array(ids, pa.int64())})
        with fs.open(f"{bucket}/hub/train-{f:05d}.parquet", "wb") as out:
            pq.write_table(table, out, row_group_size=4)
        n += count
    keys = [f"img{i:04d}" for i in range(n) if i != bad]
    spec = f"s3://{bucket}/hub/train-{{00000..{len(COUNTS) - 1:05d}}}.parquet"
    base = {"spec": spec, "storage_options": s3_server.storage_options, "workers": 1, "threads": 1,
            "parquet": True, "on_error": "skip"}
    whole = once_after_a_resume(JOB, tmp_path, base, keys, "images", 2, {"workers": 2})
    assert sum(r["skipped"].get("decode", 0) for r in whole) == 1
