"""sd.video on videos made here whose frames carry their numbers (tests/media/synth.py): a clip's
frames are the right frame numbers with the stride, seeded (IMAGE-SEED), decoded from the
keyframe before the clip to its end only; corrupt videos are FormatErrors naming the sample."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import streamdata as sd
from streamdata.formats.images import sample_key, sample_rng
from streamdata.formats.video import probe
from tests.media.synth import frame_number, video_bytes

FPS = 25


@pytest.fixture(scope="module")
def mp4() -> bytes:
    return video_bytes(100, fps=FPS, gop=10)  # 4 s, H.264, a keyframe every 10 frames


def _numbers(frames: torch.Tensor) -> list[int]:
    return [frame_number(f) for f in frames]


@pytest.mark.parametrize("codec, container", [("libx264", "mp4"), ("mpeg4", "mp4"), ("libvpx", "webm")])
def test_a_clip_is_consecutive_frames_with_the_stride(codec, container):
    data = video_bytes(60, fps=FPS, gop=8, codec=codec, container=container)
    for seed in range(6):
        out = sd.video.RandomClip(frames=5, stride=3, size=32, seed=seed)(data)
        assert out["frames"].dtype == torch.uint8 and out["frames"].shape == (5, 3, 32, 32)
        got = _numbers(out["frames"])
        assert got == list(range(got[0], got[0] + 13, 3)) and 0 <= got[0] <= 60 - 13
        assert out["pts"].tolist() == pytest.approx([k / FPS for k in got])  # its timestamps, seconds


def test_the_clip_is_the_seeds_and_the_keys(mp4):
    sample = {"__key__": "v1", "__url__": "s3://b/shard-000.tar", "mp4": mp4}
    clip = sd.video.RandomClip(frames=4, stride=2, size=16)
    first = _numbers(clip.for_pass(7, 1)(sample)["mp4"]["frames"])
    assert _numbers(clip.for_pass(7, 1)(sample)["mp4"]["frames"]) == first  # every run the same
    # the start is drawn from (seed, epoch, key) as an image's crop is: randint over the header's room
    rng = sample_rng(7, 1, sample_key(sample))
    assert first[0] == rng.randint(0, 100 - 7)
    # the same sample from another endpoint: the shard's name keys it, not the URL
    moved = {**sample, "__url__": "http://proxy:9000/b/shard-000.tar"}
    assert _numbers(clip.for_pass(7, 1)(moved)["mp4"]["frames"]) == first
    starts = {_numbers(clip.for_pass(7, e)(sample)["mp4"]["frames"])[0] for e in range(8)}
    assert len(starts) > 3  # another epoch, another clip


def test_uniform_clips_and_whole_decode(mp4):
    out = sd.video.UniformClips(3, frames=4, stride=5, size=(24, 40))(mp4)
    assert out["frames"].shape == (3, 4, 3, 24, 40) and out["pts"].shape == (3, 4)
    assert [_numbers(c) for c in out["frames"]] == [[0, 5, 10, 15], [42, 47, 52, 57], [84, 89, 94, 99]]
    whole = sd.video.Decode(stride=2)(mp4)
    assert _numbers(whole["frames"]) == list(range(0, 100, 2)) and whole["frames"].shape[1:] == (3, 64, 64)
    # a clip longer than the video repeats its last frame
    short = sd.video.RandomClip(frames=8, stride=20)(mp4)
    assert _numbers(short["frames"]) == [0, 20, 40, 60, 80, 99, 99, 99]


def test_the_header_gives_the_choice(mp4):
    info = probe(io.BytesIO(mp4))
    assert (info.num_frames, info.fps, info.width, info.height, info.codec) == (100, 25.0, 64, 64, "h264")
    assert info.duration == pytest.approx(4.0)


class _Counting(io.BytesIO):
    """A file that counts the bytes read from it."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.read_bytes = 0

    def read(self, n: int | None = -1) -> bytes:
        out = super().read(n)
        self.read_bytes += len(out)
        return out

    def readinto(self, b) -> int:  # type: ignore[override]
        n = super().readinto(b)
        self.read_bytes += n
        return n


def test_only_the_clip_is_read():
    """A clip of 2 frames of a 20 s noisy video: the header, the index and the clip's group of
    frames are read, not the file."""
    data = video_bytes(500, fps=FPS, gop=25, size=64, noise=1)
    clip = sd.video.RandomClip(frames=2, stride=1, seed=1)
    f = _Counting(data)
    got = _numbers(clip(f)["frames"])
    assert got[1] == got[0] + 1
    assert f.read_bytes < len(data) / 5, (f.read_bytes, len(data))


def test_corrupt_and_truncated_videos_are_format_errors(mp4):
    clip = sd.video.RandomClip(frames=4)
    for bad in (b"not a video at all", mp4[: len(mp4) // 3], b"\x00" * 4096):
        with pytest.raises(sd.FormatError) as info:
            clip({"__key__": "v9", "__url__": "s3://b/shard-003.tar", "mp4": bad})
        assert info.value.key == "v9" and info.value.url == "s3://b/shard-003.tar"
        assert "'mp4'" in str(info.value)


def test_a_missing_backend_names_its_extra(mp4, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` fails as where it is not installed
    with pytest.raises(sd.BackendMissingError, match=r"streamdata\[video\]"):
        sd.video.RandomClip(frames=2)(mp4)
    with pytest.raises(sd.BackendMissingError, match=r"streamdata\[video\]"):
        sd.video.RandomClip(frames=2, backend="torchcodec")(mp4)


def test_bad_arguments_are_spec_errors():
    for make in (lambda: sd.video.RandomClip(frames=0), lambda: sd.video.RandomClip(stride=0),
                 lambda: sd.video.RandomClip(size=(1, 2, 3)), lambda: sd.video.UniformClips(0),
                 lambda: sd.video.RandomClip(backend="nope"), lambda: sd.video.RandomClip(threads=0)):
        with pytest.raises(sd.SpecError):
            make()


def test_threads_give_the_same_frames(mp4):
    one = sd.video.RandomClip(frames=6, stride=2, seed=3)(mp4)
    two = sd.video.RandomClip(frames=6, stride=2, seed=3, threads=2)(mp4)
    assert torch.equal(one["frames"], two["frames"]) and torch.equal(one["pts"], two["pts"])
