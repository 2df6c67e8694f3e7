"""Decode time per modality in the stage timings (``loader.metrics()``: ``stage.decode_image_s``,
``stage.decode_video_s``, ``stage.decode_audio_s``, parts of ``stage.decode_s``), and an
``sd.ObjectDataset``'s media transforms drawing per ``(seed, epoch, key)``, on the loopback S3
server with DataLoader workers."""

from __future__ import annotations

import io

import numpy as np
import pytest

import streamdata as sd
from tests.helpers import tar_bytes
from tests.media.synth import audio_bytes, frame_number, video_bytes

KINDS = ("image", "video", "audio")


@pytest.fixture
def media_bucket(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    return server, bucket, fs


def _jpeg(seed: int) -> bytes:
    import PIL.Image

    pixels = np.random.default_rng(seed).integers(0, 255, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels).save(out, format="JPEG")
    return out.getvalue()


def _metrics(spec: str, options: dict) -> tuple[dict, list[dict]]:
    ds = sd.TarDataset(spec, storage_options=options, batch_size=2,
                       decode=[sd.video.RandomClip(frames=2, size=16), sd.audio.RandomSegment(0.25)])
    with sd.loader(ds, num_workers=2) as loader:
        n = sum(len(batch["__key__"]) for batch in loader)
        m = loader.metrics()
    assert n == 8
    return m, ds.reader_stats()


def test_decode_time_per_modality(media_bucket):
    server, bucket, fs = media_bucket
    for s in range(2):
        fs.pipe_file(f"{bucket}/all/shard-{s}.tar", tar_bytes([
            {"__key__": f"s{s}k{i}", "mp4": video_bytes(12, gop=4, size=32), "wav": audio_bytes(0.5, 8000),
             "jpg": _jpeg(i), "cls": str(i).encode()} for i in range(4)]))
        fs.pipe_file(f"{bucket}/sound/shard-{s}.tar", tar_bytes([
            {"__key__": f"s{s}k{i}", "wav": audio_bytes(0.5, 8000), "cls": str(i).encode()}
            for i in range(4)]))

    m, rows = _metrics(f"s3://{bucket}/all/shard-{{0..1}}.tar", server.storage_options)
    assert all(m[f"stage.decode_{k}_s"] > 0 for k in KINDS), m  # each modality present shows
    assert sum(m[f"stage.decode_{k}_s"] for k in KINDS) <= m["stage.decode_s"] * (1 + 1e-9), m
    assert len(rows) == 2  # two workers, each its own row (ONE-WRITER-PER-ROW)
    for row in rows:  # within each reader's row: the parts add up to at most its decode time
        assert 0 < sum(row[f"decode_{k}_ns"] for k in KINDS) <= row["decode_ns"], row

    m, rows = _metrics(f"s3://{bucket}/sound/shard-{{0..1}}.tar", server.storage_options)
    assert m["stage.decode_audio_s"] > 0 and m["stage.decode_audio_s"] <= m["stage.decode_s"] * (1 + 1e-9)
    assert m["stage.decode_image_s"] == 0 and m["stage.decode_video_s"] == 0, m  # absent: none


def test_object_dataset_clips_per_epoch(media_bucket):
    """An ObjectDataset's clip is a function of (seed, epoch, key): another epoch draws another,
    the same epoch the same with 0 or 2 (persistent) workers; its decode time shows as video."""
    server, bucket, fs = media_bucket
    keys = [f"v{i}" for i in range(4)]
    for key in keys:
        fs.pipe_file(f"{bucket}/objs/{key}.mp4", video_bytes(60, gop=5, size=32))
    url = f"s3://{bucket}/objs/"

    def clips(workers: int, seed: int = 3, epochs: int = 2) -> tuple[list[dict], dict]:
        ds = sd.ObjectDataset(url, storage_options=server.storage_options, seed=seed,
                              decode=sd.video.RandomClip(frames=2, size=16))
        out = []
        with sd.loader(ds, batch_size=2, num_workers=workers) as loader:
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                got = {}
                for batch in loader:
                    for key, frames in zip(batch["__key__"], batch["mp4"]["frames"], strict=True):
                        got[key] = [frame_number(f) for f in frames]
                assert sorted(got) == keys
                out.append(got)
            m = loader.metrics()
        ds.close()
        return out, m

    (e0, e1), m = clips(2)
    assert e0 != e1  # another epoch, other clips
    assert m["stage.decode_video_s"] > 0 and m["stage.decode_image_s"] == 0
    assert clips(0)[0] == [e0, e1]  # another worker count: the same clips
    assert clips(2, seed=4, epochs=1)[0][0] != e0  # another seed: others
    # the clip is the transform's for (seed, epoch, key), whoever decodes it
    data = fs.cat_file(f"{bucket}/objs/v2.mp4")
    for epoch, got in enumerate((e0, e1)):
        bound = sd.video.RandomClip(frames=2, size=16).for_pass(3, epoch)
        clip = bound.sample_value(data, {"__key__": "v2", "__url__": f"{url}v2.mp4"}, "mp4")
        assert [frame_number(f) for f in clip["frames"]] == got["v2"]
    with pytest.raises(sd.SpecError, match="seed"):
        sd.ObjectDataset(url, storage_options=server.storage_options, seed="3")
