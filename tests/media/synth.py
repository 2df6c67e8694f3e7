"""Media made here for the tests and benchmarks: a video whose frames carry their own number,
and tones whose samples are known at every offset.

The video: each frame's number is drawn as ``BITS`` blocks along its top rows (black or white,
the number's bits, most significant first), so a decoded frame, even scaled and compressed,
reads back as its number (:func:`frame_number`).
"""

from __future__ import annotations

import io
import math

import numpy as np

BITS = 10  # frame numbers up to 1023


def video_bytes(n_frames: int = 100, *, fps: int = 25, size: int = 64, gop: int = 10, codec: str = "libx264",
                container: str = "mp4", noise: int = 0) -> bytes:
    """An encoded video: ``n_frames`` frames ``size`` x ``size`` at ``fps``, a keyframe every
    ``gop`` frames, frame k's number drawn in its top blocks (``noise``: random grey pixels below
    them, making a larger file)."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as c:
        stream = c.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "bf": "0", "g": str(gop), "keyint_min": str(gop),
                              "sc_threshold": "0", "crf": "6"}
        elif codec == "libvpx":
            stream.options = {"g": str(gop), "keyint_min": str(gop), "deadline": "realtime", "cpu-used": "8"}
        else:
            stream.options = {"g": str(gop), "qmin": "1", "qmax": "3"}
        rng = np.random.default_rng(0)
        for k in range(n_frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(k, size, rng if noise else None), format="rgb24")
            for packet in stream.encode(frame):
                c.mux(packet)
        for packet in stream.encode():
            c.mux(packet)
    return out.getvalue()


def frame_pixels(k: int, size: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """Frame ``k``: ``uint8 [size, size, 3]``, its number in the top blocks."""
    pixels = np.full((size, size, 3), 128, dtype=np.uint8)
    if rng is not None:
        pixels[size // 2:] = rng.integers(0, 256, (size - size // 2, size, 3), dtype=np.uint8)
    for b in range(BITS):
        on = (k >> (BITS - 1 - b)) & 1
        pixels[: size // 2, round(b * size / BITS):round((b + 1) * size / BITS)] = 255 if on else 0
    return pixels


def frame_number(chw) -> int:
    """The number drawn in a decoded frame (``[3, H, W]``, any size: the blocks scale with it)."""
    a = np.asarray(chw, dtype=np.float64)
    _, h, width = a.shape
    w = width / BITS
    n = 0
    for b in range(BITS):
        x0, x1 = int(b * w + w * 0.3), int(b * w + w * 0.7)
        block = a[:, int(h * 0.1):int(h * 0.4), x0:max(x1, x0 + 1)].mean()
        n = (n << 1) | int(block > 128)
    return n


def tone(seconds: float, rate: int = 16000, channels: int = 2, freq: float = 440.0) -> np.ndarray:
    """A sine per channel (channel c at ``freq * (c + 1)``, amplitude 0.5, phase 0 at sample 0):
    ``float32 [N, C]``."""
    t = np.arange(int(round(seconds * rate))) / rate
    return np.stack([0.5 * np.sin(2 * math.pi * freq * (c + 1) * t) for c in range(channels)], axis=1).astype(
        np.float32)


def audio_bytes(seconds: float, rate: int = 16000, channels: int = 2, fmt: str = "WAV") -> bytes:
    """:func:`tone` encoded by soundfile (``WAV`` as float32, ``FLAC`` as 24-bit)."""
    import soundfile

    out = io.BytesIO()
    subtype = {"WAV": "FLOAT", "FLAC": "PCM_24", "OGG": "VORBIS"}[fmt]
    soundfile.write(out, tone(seconds, rate, channels), rate, format=fmt, subtype=subtype)
    return out.getvalue()
