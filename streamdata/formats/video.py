"""Video clips decoded only as far as they need: ``sd.video``.

A transform here (:class:`RandomClip`, :class:`UniformClips`, :class:`Decode`) takes a video's
encoded bytes (``.mp4``, ``.webm``, ``.mkv``...; or a seekable file, such as a
:class:`~streamdata.formats.ranged.RangedFile` over a large object) and gives
``{"frames": uint8 [T, 3, H, W], "pts": float64 [T]}`` (``pts``: each frame's time in seconds;
:class:`UniformClips` adds a leading clip dimension to both). The clip is chosen from the
container's header (duration, frame rate, stream time base): no frame is decoded to choose it.
Then the demuxer seeks to the keyframe at or before the clip's first frame and decodes to its
last one, no further; only the frames kept are converted to RGB and resized (FFmpeg's
``swscale``, through PyAV's ``reformat``).

A clip of ``frames`` frames ``stride`` apart takes the frames ``s, s + stride, ...`` of the
stream's frame grid (frame ``k`` at ``start + k / fps``), each the first decoded frame at or
after its time less half a frame; a video shorter than the clip repeats its last frame.
``size``: an int scales the shorter side to it, then takes the centre square; a pair
``(height, width)`` scales to it; ``None`` keeps the stream's size.

Seeded as IMAGE-SEED (``formats/media.py``). Decoders: PyAV (``streamdata[video]``) by
default, ``threads`` codec threads each (FFmpeg's frame and slice threads, bounded);
``backend="torchcodec"`` where torchcodec imports. A corrupt or truncated video is a
:class:`~streamdata.errors.FormatError` naming the sample's key and URL.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any, BinaryIO

from streamdata.errors import FormatError, SpecError
from streamdata.formats.media import MediaTransform, import_backend, seek_before

__all__ = ["EXTENSIONS", "Decode", "RandomClip", "UniformClips", "VideoInfo", "VideoTransform", "probe"]

EXTENSIONS = frozenset({"mp4", "m4v", "mov", "webm", "mkv", "avi", "ogv", "mpg", "mpeg", "ts", "flv"})
BACKENDS = ("auto", "av", "torchcodec")


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What a video's header says (nothing decoded): its first video stream's."""

    duration: float  # seconds
    fps: float
    num_frames: int
    width: int
    height: int
    codec: str
    start: float  # the first frame's time, seconds
    time_base: float  # seconds per tick of the stream's timestamps


def _size(size: int | Sequence[int] | None) -> tuple[int, int] | int | None:
    if size is None:
        return None
    if isinstance(size, int) and size > 0:
        return size
    pair = tuple(size) if not isinstance(size, int) else ()
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise SpecError(f"size must be None, a positive int or (height, width), got {size!r}")
    return int(pair[0]), int(pair[1])


def probe(source: BinaryIO) -> VideoInfo:
    """A video's :class:`VideoInfo` from its header (PyAV)."""
    av = import_backend("av")
    with av.open(source, mode="r") as container:
        return _info(container, _stream(container))


def _stream(container: Any) -> Any:
    if not container.streams.video:
        raise FormatError("the file holds no video stream")
    return container.streams.video[0]


def _info(container: Any, stream: Any) -> VideoInfo:
    tb = float(stream.time_base) if stream.time_base else 1e-6
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    start = stream.start_time * tb if stream.start_time is not None else 0.0
    if stream.duration:
        duration = stream.duration * tb
    elif container.duration:
        duration = container.duration / 1_000_000 - max(start, 0.0)
    else:
        duration = 0.0
    n = int(stream.frames or 0)
    if n <= 0 and fps > 0:
        n = int(math.floor(duration * fps + 0.5))
    if fps <= 0 and n > 0 and duration > 0:
        fps = n / duration
    if fps <= 0 or n <= 0:
        raise FormatError(f"the video's header gives no frame rate or duration (fps {fps}, {n} frames)")
    ctx = stream.codec_context
    return VideoInfo(duration=duration, fps=fps, num_frames=n, width=int(ctx.width), height=int(ctx.height),
                     codec=str(ctx.name), start=start, time_base=tb)


class VideoTransform(MediaTransform):
    """Clips of a video (see the module's notes); subclasses say which frames (:meth:`clips`)."""

    EXTENSIONS = EXTENSIONS
    KIND = "video"

    def __init__(self, frames: int = 16, stride: int = 1, size: int | Sequence[int] | None = None, *,
                 field: str | None = None, seed: int | None = None, threads: int = 1,
                 backend: str = "auto") -> None:
        super().__init__(field=field, seed=seed, threads=threads, backend=backend)
        if not isinstance(frames, int) or frames < 1 or not isinstance(stride, int) or stride < 1:
            raise SpecError(f"frames and stride must be ints >= 1, got {frames!r}, {stride!r}")
        if backend not in BACKENDS:
            raise SpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.frames, self.stride, self.size = frames, stride, _size(size)

    def clips(self, info: VideoInfo, rng: random.Random) -> list[list[int]]:
        """The frame numbers of each clip, from the header alone."""
        raise NotImplementedError

    def span(self) -> int:
        """Frames of the stream one clip covers."""
        return (self.frames - 1) * self.stride + 1

    def clip_at(self, first: int, info: VideoInfo) -> list[int]:
        last = info.num_frames - 1
        return [min(first + i * self.stride, last) for i in range(self.frames)]

    def decode(self, source: BinaryIO, rng: random.Random, name: str | None) -> Any:
        if self.backend == "torchcodec":
            return self._torchcodec(source, rng)
        av = import_backend("av")
        with av.open(source, mode="r") as container:
            stream = _stream(container)
            info = _info(container, stream)
            ctx = stream.codec_context
            ctx.thread_count = self.threads
            ctx.thread_type = "AUTO" if self.threads > 1 else "SLICE"
            clips = self.clips(info, rng)
            decoded = [_decode_frames(container, stream, info, clip, self.size) for clip in clips]
        return self._out(decoded)

    def _out(self, decoded: list[tuple[Any, Any]]) -> dict:
        import torch

        frames = [torch.from_numpy(f) for f, _ in decoded]
        pts = [torch.tensor(p, dtype=torch.float64) for _, p in decoded]
        if self.stacked():
            return {"frames": torch.stack(frames), "pts": torch.stack(pts)}
        return {"frames": frames[0], "pts": pts[0]}

    def stacked(self) -> bool:
        """Whether the output has a leading clip dimension."""
        return False

    def _torchcodec(self, source: BinaryIO, rng: random.Random) -> dict:
        """The same clips through torchcodec (its header for the choice, its seek-and-decode)."""
        import numpy as np

        decoders = import_backend("torchcodec.decoders", "video")
        source.seek(0)
        decoder = decoders.VideoDecoder(source.read(), num_ffmpeg_threads=self.threads)
        meta = decoder.metadata
        fps = float(meta.average_fps or 0)
        n = int(meta.num_frames or 0)
        if fps <= 0 or n <= 0:
            raise FormatError("the video's header gives no frame rate or frame count")
        start = float(getattr(meta, "begin_stream_seconds", 0.0) or 0.0)
        info = VideoInfo(duration=float(meta.duration_seconds or n / fps), fps=fps, num_frames=n,
                         width=int(meta.width), height=int(meta.height), codec=str(meta.codec),
                         start=start, time_base=0.0)
        decoded = []
        for clip in self.clips(info, rng):
            batch = decoder.get_frames_played_at([start + k / fps for k in clip])
            frames = _resized_tensor(batch.data, self.size)
            decoded.append((frames.numpy(), np.asarray(batch.pts_seconds, dtype=np.float64)))
        return self._out(decoded)


def _resized_tensor(frames: Any, size: tuple[int, int] | int | None) -> Any:
    """``uint8 [T, 3, H, W]`` scaled and cropped as ``size`` says (torch's antialiased kernel)."""
    import torch

    if size is None:
        return frames
    h, w = frames.shape[-2:]
    oh, ow, crop = _out_size(w, h, size)
    out = torch.nn.functional.interpolate(frames, size=(oh, ow), mode="bilinear", antialias=True,
                                          align_corners=False)
    if crop is not None:
        y, x = (oh - crop[0]) // 2, (ow - crop[1]) // 2
        out = out[..., y:y + crop[0], x:x + crop[1]]
    return out.contiguous()


def _out_size(width: int, height: int,
              size: tuple[int, int] | int) -> tuple[int, int, tuple[int, int] | None]:
    """The scaled ``(height, width)`` and the centre crop after it (``None``: none)."""
    if isinstance(size, int):
        k = size / min(width, height)
        return max(size, round(height * k)), max(size, round(width * k)), (size, size)
    return size[0], size[1], None


def _decode_frames(container: Any, stream: Any, info: VideoInfo, clip: list[int],
                   size: tuple[int, int] | int | None) -> tuple[Any, Any]:
    """The frames numbered ``clip`` (ascending): one seek to the keyframe at or before the first,
    decoded up to the last; ``(uint8 [T, 3, H, W], float64 [T] seconds)``."""
    import numpy as np

    times = [info.start + k / info.fps for k in clip]
    half = 0.5 / info.fps
    offset = max(int((times[0] - half) / info.time_base), stream.start_time or 0)
    seek_before(container, stream, offset, stream.start_time or 0)
    out: list[Any] = []
    pts: list[float] = []
    i, last, last_rgb, last_t = 0, None, None, 0.0
    for frame in container.decode(stream):
        t = frame.time if frame.time is not None else (frame.pts or 0) * info.time_base
        rgb = None
        while i < len(times) and t >= times[i] - half:
            if rgb is None:
                rgb = _rgb(frame, size)
            out.append(rgb)
            pts.append(t)
            i += 1
        last, last_rgb, last_t = frame, rgb, t
        if i == len(times):
            break
    if i < len(times):  # the stream ended first (a clip longer than the video): its last frame again
        if last is None:
            raise FormatError("no frame could be decoded")
        fill = last_rgb if last_rgb is not None else _rgb(last, size)
        out += [fill] * (len(times) - i)
        pts += [last_t] * (len(times) - i)
    return np.stack(out), np.asarray(pts, dtype=np.float64)


def _rgb(frame: Any, size: tuple[int, int] | int | None) -> Any:
    """One frame as ``uint8 [3, H, W]``, scaled (swscale) and cropped as ``size`` says."""
    import numpy as np

    # threads=1: swscale's own slice threads would be one pool per frame, unbounded by ``threads``
    # (and FFmpeg's pool teardown can hang in a DataLoader worker)
    if size is None:
        hwc = frame.to_ndarray(format="rgb24", threads=1)
    else:
        oh, ow, crop = _out_size(frame.width, frame.height, size)
        scaled = frame.reformat(width=ow, height=oh, format="rgb24", interpolation="AREA", threads=1)
        hwc = scaled.to_ndarray()
        if crop is not None:
            y, x = (oh - crop[0]) // 2, (ow - crop[1]) // 2
            hwc = hwc[y:y + crop[0], x:x + crop[1]]
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


class RandomClip(VideoTransform):
    """One clip of ``frames`` frames ``stride`` apart, starting at a seeded random frame
    (IMAGE-SEED), scaled to ``size``."""

    def clips(self, info: VideoInfo, rng: random.Random) -> list[list[int]]:
        first = rng.randint(0, max(info.num_frames - self.span(), 0))
        return [self.clip_at(first, info)]


class UniformClips(VideoTransform):
    """``n`` clips spread evenly over the video (the first at its start, the last at its end;
    no randomness): ``frames`` ``[n, T, 3, H, W]``, ``pts`` ``[n, T]``."""

    def __init__(self, n: int, frames: int = 16, stride: int = 1, size: int | Sequence[int] | None = None,
                 **options: Any) -> None:
        super().__init__(frames, stride, size, **options)
        if not isinstance(n, int) or n < 1:
            raise SpecError(f"n must be an int >= 1, got {n!r}")
        self.n = n

    def clips(self, info: VideoInfo, rng: random.Random) -> list[list[int]]:
        room = max(info.num_frames - self.span(), 0)
        firsts = [room // 2] if self.n == 1 else [round(j * room / (self.n - 1)) for j in range(self.n)]
        return [self.clip_at(first, info) for first in firsts]

    def stacked(self) -> bool:
        return True


class Decode(VideoTransform):
    """The whole video, every ``stride``-th frame, scaled to ``size``."""

    def __init__(self, size: int | Sequence[int] | None = None, *, stride: int = 1, **options: Any) -> None:
        super().__init__(1, stride, size, **options)

    def clips(self, info: VideoInfo, rng: random.Random) -> list[list[int]]:
        return [list(range(0, info.num_frames, self.stride))]
