"""Audio segments decoded only as far as they need: ``sd.audio``.

A transform here (:class:`RandomSegment`, :class:`Decode`) takes an audio file's encoded bytes
(``.wav``, ``.flac``, ``.ogg``, ``.mp3``, ``.m4a``, ``.opus``...; or a seekable binary file)
and gives ``{"samples": float32 [C, N], "start": seconds, "sample_rate": int}``. The segment
is chosen from the header (frame count, sample rate), then only its samples are decoded:
soundfile (``streamdata[audio]``) seeks to the segment's first frame in WAV, FLAC and Ogg
Vorbis/Opus files and reads ``N``; PyAV (the other formats, or ``backend="av"``) seeks to the
packet at or before it and decodes to its end, cut to the sample. ``sample_rate``: the output's
rate (resampled by FFmpeg's ``swresample`` through PyAV where the file's differs; ``None``
keeps the file's). A file shorter than the segment is padded with zeros at its end.

Seeded as IMAGE-SEED (``formats/media.py``). A corrupt or truncated file is a
:class:`~streamdata.errors.FormatError` naming the sample's key and URL.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, BinaryIO

from streamdata.errors import FormatError, SpecError
from streamdata.formats.media import MediaTransform, import_backend, seek_before

__all__ = ["EXTENSIONS", "AudioInfo", "AudioTransform", "Decode", "RandomSegment", "probe"]

EXTENSIONS = frozenset({"wav", "flac", "ogg", "oga", "opus", "mp3", "m4a", "aac", "aiff", "aif"})
BACKENDS = ("auto", "soundfile", "av")
# soundfile's containers, told by their first bytes (its own formats are read by it under "auto")
_SOUNDFILE_MAGIC = (b"RIFF", b"fLaC", b"OggS", b"FORM", b"RF64")


@dataclasses.dataclass(frozen=True)
class AudioInfo:
    """What an audio file's header says (nothing decoded)."""

    frames: int  # samples per channel
    sample_rate: int
    channels: int
    codec: str

    @property
    def duration(self) -> float:
        return self.frames / self.sample_rate if self.sample_rate else 0.0


def probe(source: BinaryIO) -> AudioInfo:
    """An audio file's :class:`AudioInfo` from its header (soundfile where it reads the file, else PyAV)."""
    head = source.read(4)
    source.seek(0)
    if head in _SOUNDFILE_MAGIC:
        sf = _soundfile_or_none()
        if sf is not None:
            with sf.SoundFile(source) as f:
                return AudioInfo(f.frames, f.samplerate, f.channels, f"{f.format}/{f.subtype}".lower())
    av = import_backend("av", "audio")
    with av.open(source, mode="r") as container:
        stream = _stream(container)
        return _av_info(container, stream)


def _soundfile_or_none() -> Any:
    try:
        return import_backend("soundfile", "audio")
    except ImportError:
        return None


def _stream(container: Any) -> Any:
    if not container.streams.audio:
        raise FormatError("the file holds no audio stream")
    return container.streams.audio[0]


def _av_info(container: Any, stream: Any) -> AudioInfo:
    rate = int(stream.codec_context.sample_rate or stream.rate or 0)
    if stream.duration and stream.time_base:
        seconds = float(stream.duration * stream.time_base)
    elif container.duration:
        seconds = container.duration / 1_000_000
    else:
        seconds = 0.0
    frames = int(stream.frames) if stream.frames and stream.codec_context.name.startswith("pcm") else 0
    frames = frames or int(round(seconds * rate))
    if rate <= 0 or frames <= 0:
        raise FormatError(f"the audio's header gives no sample rate or duration ({rate} Hz, {seconds} s)")
    return AudioInfo(frames, rate, int(stream.codec_context.channels), str(stream.codec_context.name))


class AudioTransform(MediaTransform):
    """Segments of an audio file (see the module's notes); subclasses say which (:meth:`segment`)."""

    EXTENSIONS = EXTENSIONS
    KIND = "audio"

    def __init__(self, sample_rate: int | None = None, *, mono: bool = False, field: str | None = None,
                 seed: int | None = None, threads: int = 1, backend: str = "auto") -> None:
        super().__init__(field=field, seed=seed, threads=threads, backend=backend)
        if backend not in BACKENDS:
            raise SpecError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if sample_rate is not None and (not isinstance(sample_rate, int) or sample_rate <= 0):
            raise SpecError(f"sample_rate must be None or a positive int, got {sample_rate!r}")
        self.sample_rate, self.mono = sample_rate, bool(mono)

    def segment(self, info: AudioInfo, rng: random.Random) -> tuple[int, int]:
        """``(first, count)`` in the file's samples, from the header alone."""
        raise NotImplementedError

    def decode(self, source: BinaryIO, rng: random.Random, name: str | None) -> Any:
        import numpy as np
        import torch

        head = source.read(4)
        source.seek(0)
        use_sf = self.backend == "soundfile" or (self.backend == "auto" and head in _SOUNDFILE_MAGIC)
        sf = _soundfile_or_none() if use_sf and self.backend == "auto" else (
            import_backend("soundfile", "audio") if use_sf else None)
        if sf is not None:
            with sf.SoundFile(source) as f:
                info = AudioInfo(f.frames, f.samplerate, f.channels, f.format)
                first, count = self.segment(info, rng)
                f.seek(first)
                data = f.read(count, dtype="float32", always_2d=True).T  # [C, n]
        else:
            info, first, count, data = self._av(source, rng)
        if data.shape[1] < count:  # past the file's end: zeros
            pad = np.zeros((data.shape[0], count - data.shape[1]), np.float32)
            data = np.concatenate([data, pad], axis=1)
        data = data[:, :count]
        if self.mono and data.shape[0] > 1:
            data = data.mean(axis=0, keepdims=True)
        rate = info.sample_rate
        if self.sample_rate is not None and self.sample_rate != rate:
            data = resample(data, rate, self.sample_rate)
            rate = self.sample_rate
        return {"samples": torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)),
                "start": first / info.sample_rate, "sample_rate": rate}

    def _av(self, source: BinaryIO, rng: random.Random) -> tuple[AudioInfo, int, int, Any]:
        """PyAV: seek to the packet at or before the segment, decode to its end, cut to the sample."""
        import numpy as np

        av = import_backend("av", "audio")
        with av.open(source, mode="r") as container:
            stream = _stream(container)
            stream.codec_context.thread_count = self.threads
            info = _av_info(container, stream)
            first, count = self.segment(info, rng)
            tb = float(stream.time_base)
            start_ts = stream.start_time or 0
            if first > 0:
                seek_before(container, stream, start_ts + int(first / info.sample_rate / tb), start_ts)
            to_float = av.AudioResampler(format="fltp")  # any sample format -> planar float
            parts: list[Any] = []
            got_from = None  # the file sample of parts' first sample
            have = 0
            for frame in container.decode(stream):
                if frame.pts is not None:
                    at = int(round((frame.pts - start_ts) * tb * info.sample_rate))
                else:
                    at = (got_from or 0) + have
                for out in to_float.resample(frame):
                    arr = out.to_ndarray().reshape(info.channels, -1)
                    if got_from is None:
                        got_from = at
                    parts.append(arr)
                    have += arr.shape[1]
                if got_from is not None and got_from + have >= first + count:
                    break
            if not parts:
                raise FormatError("no audio could be decoded")
            data = np.concatenate(parts, axis=1)
            skip = max(first - (got_from or 0), 0)
            return info, first, count, data[:, skip:]


def resample(data: Any, rate: int, to: int) -> Any:
    """``float32 [C, N]`` at ``rate`` -> at ``to`` (FFmpeg's swresample, through PyAV), length
    ``round(N * to / rate)``."""
    import numpy as np

    av = import_backend("av", "audio")
    channels, n = data.shape
    layout = {1: "mono", 2: "stereo"}.get(channels)
    if layout is None:  # swresample per channel, each as mono
        return np.concatenate([resample(data[c:c + 1], rate, to) for c in range(channels)], axis=0)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data, dtype=np.float32), format="fltp",
                                       layout=layout)
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=to)
    parts = [f.to_ndarray() for f in [*resampler.resample(frame), *resampler.resample(None)]]
    out = np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), np.float32)
    want = int(round(n * to / rate))
    if out.shape[1] < want:
        out = np.concatenate([out, np.zeros((channels, want - out.shape[1]), np.float32)], axis=1)
    return out[:, :want]


class RandomSegment(AudioTransform):
    """``seconds`` of audio from a seeded random start (IMAGE-SEED), at ``sample_rate``."""

    def __init__(self, seconds: float, sample_rate: int | None = None, **options: Any) -> None:
        super().__init__(sample_rate, **options)
        if not seconds > 0:
            raise SpecError(f"seconds must be > 0, got {seconds!r}")
        self.seconds = float(seconds)

    def segment(self, info: AudioInfo, rng: random.Random) -> tuple[int, int]:
        count = max(int(round(self.seconds * info.sample_rate)), 1)
        return rng.randint(0, max(info.frames - count, 0)), count


class Decode(AudioTransform):
    """The whole file, at ``sample_rate``."""

    def segment(self, info: AudioInfo, rng: random.Random) -> tuple[int, int]:
        return 0, info.frames
