"""sd.video and sd.audio in the datasets, on the loopback S3 server: a tar of videos and tones
through sd.TarDataset (every sample once, the same clips in every run and world, decode time in
the stage timings), corrupt members raised or skipped and counted, a large video object read by
ranged requests through sd.ObjectDataset, media members kept as they are by ShardWriter,
`streamdata convert` and shown by `streamdata inspect`."""

from __future__ import annotations

import json

import pytest
import torch

import streamdata as sd
from streamdata.cli import main
from tests.helpers import check_one_corrupt, doc_blocks, s3_environment, tar_bytes
from tests.media.synth import audio_bytes, frame_number, tone, video_bytes

COUNTS = [3, 5, 4]  # samples per shard


@pytest.fixture
def media_bucket(s3_bucket):
    import s3fs

    server, bucket = s3_bucket
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    return server, bucket, fs


def _shards(fs, prefix: str, corrupt: str | None = None) -> list[str]:
    keys, n = [], 0
    for s, count in enumerate(COUNTS):
        samples = []
        for _ in range(count):
            key = f"clip{n:03d}"
            video = video_bytes(30 + 7 * n, fps=25, gop=6)
            samples.append({"__key__": key, "mp4": b"garbage" if key == corrupt else video,
                            "wav": audio_bytes(1.0 + 0.25 * n, 8000, channels=1), "cls": str(n).encode()})
            keys.append(key)
            n += 1
        fs.pipe_file(f"{prefix}/shard-{s:03d}.tar", tar_bytes(samples))
    return keys


def _clips(loader) -> dict[str, tuple[list[int], float]]:
    out = {}
    for batch in loader:
        for i, key in enumerate(batch["__key__"]):
            assert key not in out, key
            frames = batch["mp4"]["frames"][i]
            numbers = [frame_number(f) for f in frames]
            assert batch["mp4"]["pts"][i].tolist() == pytest.approx([k / 25 for k in numbers])
            start = float(batch["wav"]["start"][i])
            n = int(batch["cls"][i])
            signal = tone(1.0 + 0.25 * n, 8000, channels=1).T
            first = round(start * 8000)
            assert torch.allclose(batch["wav"]["samples"][i], torch.from_numpy(signal[:, first:first + 4000]),
                                  atol=1e-6)
            out[key] = (numbers, start)
    return out


def test_tar_of_videos_every_sample_once_and_the_same_clips(media_bucket):
    server, bucket, fs = media_bucket
    keys = _shards(fs, f"{bucket}/media")
    spec = f"s3://{bucket}/media/shard-{{000..002}}.tar"

    def run(workers: int, threads: int = 1, **kw) -> dict:
        ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=3, shuffle=True, seed=4,
                           decode=[sd.video.RandomClip(frames=4, stride=2, size=32),
                                   sd.audio.RandomSegment(0.5)], decode_threads=threads, **kw)
        with sd.loader(ds, num_workers=workers) as loader:
            got = _clips(loader)
            stats = loader.metrics()
        assert sorted(got) == keys  # every sample exactly once
        return got, stats

    first, stats = run(2)
    assert stats["stage.decode_s"] > 0  # decode time shows in the stage timings
    for other in (run(0)[0], run(1, threads=2)[0]):  # another world, thread count: the same clips
        assert other == first
    # every clip is 4 frames 2 apart
    assert all(nums == list(range(nums[0], nums[0] + 8, 2)) for nums, _ in first.values())
    # map= over raw bytes: the same clips as decode=
    ds = sd.TarDataset(spec, storage_options=server.storage_options, batch_size=3, seed=4, decode=True,
                       map=sd.video.RandomClip(frames=4, stride=2, size=32))
    with sd.loader(ds, num_workers=0) as loader:
        mapped = {k: [frame_number(f) for f in v] for b in loader
                  for k, v in zip(b["__key__"], b["mp4"]["frames"], strict=True)}
    assert mapped == {k: v[0] for k, v in first.items()}


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_corrupt_video_in_a_shard(media_bucket, policy):
    server, bucket, fs = media_bucket
    keys = _shards(fs, f"{bucket}/bad", corrupt="clip004")
    ds = sd.TarDataset(f"s3://{bucket}/bad/shard-{{000..002}}.tar", storage_options=server.storage_options,
                       batch_size=2, decode=sd.video.RandomClip(frames=2, size=16), on_error=policy)
    check_one_corrupt(ds, policy, keys, "clip004", sd.FormatError, "shard-001.tar", "format")


def test_a_large_video_object_read_by_ranges(media_bucket):
    """A 2-second clip of a 40 s video stored as its own object: the index and the clip's
    ranges are read, a small part of the object; the frames are those of the whole read."""
    server, bucket, fs = media_bucket
    data = video_bytes(1000, fps=25, gop=25, size=96, noise=1)
    fs.pipe_file(f"{bucket}/big/v000.mp4", data)
    clip = sd.video.RandomClip(frames=25, stride=2, seed=9)
    ranged = sd.ObjectDataset(f"s3://{bucket}/big/", storage_options=server.storage_options, decode=clip,
                              ranged=True)
    whole = sd.ObjectDataset(f"s3://{bucket}/big/", storage_options=server.storage_options, decode=clip)
    got, want = ranged[0], whole[0]
    assert torch.equal(got["mp4"]["frames"], want["mp4"]["frames"])
    numbers = [frame_number(f) for f in got["mp4"]["frames"]]
    assert numbers == list(range(numbers[0], numbers[0] + 50, 2))
    stats = ranged.reader_stats()
    read = sum(r["bytes"] for r in stats)
    assert 0 < read < len(data) / 5, (read, len(data))  # ~17%: 2 s, the keyframe before, a round read ahead
    ranged.close()
    whole.close()
    with pytest.raises(sd.SpecError, match="ranged=True"):
        sd.ObjectDataset(f"s3://{bucket}/big/", storage_options=server.storage_options, ranged=True)


def test_media_members_are_kept_as_they_are(media_bucket, tmp_path, capsys):
    server, bucket, fs = media_bucket
    video, wav, flac = video_bytes(20), audio_bytes(0.5, 8000), audio_bytes(2.0, 16000, fmt="FLAC")
    with sd.ShardWriter(f"s3://{bucket}/w/shard-%03d.tar", storage_options=server.storage_options,
                        progress=False) as sink:
        sink.write({"__key__": "a", "mp4": video, "wav": wav, "flac": flac})
    (sample,) = list(sd.TarDataset(f"s3://{bucket}/w/", storage_options=server.storage_options, decode=False))
    assert (sample["mp4"], sample["wav"], sample["flac"]) == (video, wav, flac)

    src = tmp_path / "clips"
    src.mkdir()
    (src / "one.mp4").write_bytes(video)
    (src / "two.wav").write_bytes(wav)
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "out"), "--shuffle", "0"]) == 0
    assert capsys.readouterr().out.startswith("wrote 2 samples (1 video, 1 audio file, ")  # named as they are
    samples = list(sd.TarDataset(str(tmp_path / "out/"), decode=False))
    assert [s.get("mp4") or s.get("wav") for s in samples] == [video, wav]  # by path: one.mp4, two.wav

    assert main(["inspect", f"s3://{bucket}/w/", "-o", json.dumps(server.storage_options)]) == 0
    out = capsys.readouterr().out
    fields = {line.split()[0]: line for line in out.split("\n") if line.startswith("  ")}
    assert "video h264 [20, 64, 64]" in fields["mp4"] and "0.80 s, 25 fps, 64x64, h264" in fields["mp4"]
    assert "2.00 s, 16000 Hz, 2 ch, flac" in fields["flac"] and "8000 Hz" in fields["wav"]



def test_the_docs_recipe_runs(media_bucket, monkeypatch):
    """docs/media.md's recipe as written (its bucket pointed at the test server's): two epochs,
    every sample in each, clips and audio segments of the shapes the page gives."""
    server, bucket, fs = media_bucket
    for s in range(4):
        samples = [{"__key__": f"k{s}{i}", "mp4": video_bytes(40, gop=10, size=32),
                    "wav": audio_bytes(2.5, 16000, channels=1)} for i in range(3)]
        fs.pipe_file(f"{bucket}/kinetics/train-{s:06d}.tar", tar_bytes(samples))
    code = doc_blocks("docs/media.md", "## Recipe")[0].replace("s3://bkt/", f"s3://{bucket}/")
    s3_environment(monkeypatch, server.storage_options)
    seen: list[tuple] = []
    namespace = {"train_step": lambda clips, times, audio: seen.append((clips.shape, times.shape,
                                                                       audio.shape))}
    exec(compile(code, "docs/media.md", "exec"), namespace)  # noqa: S102 - the page's recipe, run
    assert sum(c[0] for c, _, _ in seen) == 2 * 12
    assert all(c[1:] == (16, 3, 112, 112) and t[1:] == (16,) and a[1:] == (1, 32000) for c, t, a in seen)
