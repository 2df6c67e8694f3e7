"""What ``sd.video`` and ``sd.audio`` share: a transform of a sample's media fields, seeded like
an image's crop, its backends imported only when used, its failures typed.

A :class:`MediaTransform` takes a media member's encoded bytes (or a seekable binary file, such
as :class:`~streamdata.formats.ranged.RangedFile` over a large object) and gives tensors and
timestamps. It reads the container's header first (duration, rate, time base) to choose what
to decode, then decodes only that (``formats/video.py``, ``formats/audio.py``).

Seeded as IMAGE-SEED (``formats/images.py``): a sample's clip or segment is a function of
``(seed, epoch, key)`` alone, the key being the sample's ``__key__`` and shard name, so the same
sample gets the same clip in every run, on every world size and after a resume.

Used as ``decode=`` of a tar or object dataset (the media fields take this path, the others are
decoded as ``decode=True`` decodes them; a list of transforms, images' included, decodes each
its own fields), as ``map=`` over samples whose media fields are still bytes, or called on bytes.
Corrupt or truncated media is a :class:`~streamdata.errors.FormatError` naming the sample's key
and URL (skipped and counted under ``on_error="skip"``, as ``skipped.format``).
"""

from __future__ import annotations

import copy
import importlib
import io
import random
from typing import Any, BinaryIO

from streamdata.errors import BackendMissingError, DecodeError, FormatError, SpecError, StreamDataError
from streamdata.formats.seeding import sample_key, sample_rng

__all__ = ["MediaTransform", "import_backend", "media_source", "named_error", "seek_before"]

# the extra that installs each backend (pyproject.toml's optional dependencies)
_EXTRAS = {"av": "video", "soundfile": "audio", "torchcodec": "video"}


def import_backend(name: str, extra: str | None = None) -> Any:
    """The backend module ``name`` (``av``, ``soundfile``, ``torchcodec``), or a
    :class:`BackendMissingError` naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except (ImportError, OSError) as exc:  # OSError: soundfile without its libsndfile
        extra = extra or _EXTRAS.get(name, "video")
        raise BackendMissingError(f"{name} is not installed or does not load ({exc}): "
                                  f"pip install 'streamdata[{extra}]'") from exc


def seek_before(container: Any, stream: Any, ts: int, floor: int = 0) -> None:
    """Seek ``container`` (PyAV) to the keyframe at or before ``ts`` (``stream``'s time base):
    where the demuxer refuses that point (FFmpeg's FLAC demuxer does for some), an earlier one,
    down to ``floor`` (the stream's start) where decoding runs from the beginning."""
    av = import_backend("av")
    step = max((ts - floor) // 4, 1)
    target = ts
    while True:
        try:
            container.seek(max(target, floor), stream=stream, backward=True, any_frame=False)
            return
        except av.FFmpegError:
            if target <= floor:
                raise
            target -= step


def media_source(value: Any) -> BinaryIO:
    """A seekable binary file over ``value``: bytes, or a file already (left as it is)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return io.BytesIO(value)
    if hasattr(value, "read") and hasattr(value, "seek"):
        return value
    raise DecodeError(f"expected encoded media (bytes or a binary file), got {type(value).__name__}")


# what a decoder raises on corrupt or truncated media (av.FFmpegError's subclasses are
# ValueError / OSError ones; soundfile's LibsndfileError is a RuntimeError); anything else is a bug
_CORRUPT = (ValueError, OSError, RuntimeError, EOFError, IndexError)


def named_error(exc: BaseException, sample: dict | None, field: str | None) -> BaseException:
    """``exc`` as our error naming the sample's key and URL: a DecodeError stays one (its
    subclass kept), a decoder's failure is a FormatError (corrupt or truncated media); our
    other errors (a missing backend) and bugs are left as they are."""
    if isinstance(exc, StreamDataError) and not isinstance(exc, DecodeError):
        return exc
    if not isinstance(exc, (DecodeError, *_CORRUPT)):
        return exc
    sample = sample or {}
    url, key = _text(sample.get("__url__")), _text(sample.get("__key__"))
    where = f"field {field!r} of sample {key!r} in {url}: " if field is not None else ""
    if isinstance(exc, DecodeError):
        message = exc.args[0] if exc.args else str(exc)
        return type(exc)(f"cannot decode {where}{message}", url=url or exc.url,
                         key=key or getattr(exc, "key", None))
    return FormatError(f"cannot decode {where}{type(exc).__name__}: {exc}", url=url, key=key)


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class MediaTransform:
    """A transform of a sample's media fields (see the module's notes). Subclasses set
    ``EXTENSIONS`` (the fields they take by default) and :meth:`decode`.

    ``field``: the one field to take (default: every field whose extension is in
    ``EXTENSIONS``); ``seed``: its own seed (default: the dataset's); ``threads``: the decoder's
    threads (bounded: DataLoader workers are the parallelism)."""

    EXTENSIONS: frozenset[str] = frozenset()
    KIND = "media"

    def __init__(self, *, field: str | None = None, seed: int | None = None, threads: int = 1,
                 backend: str = "auto") -> None:
        if not isinstance(threads, int) or threads < 1:
            raise SpecError(f"threads must be an int >= 1, got {threads!r}")
        self.field, self.seed, self.threads, self.backend = field, seed, threads, backend
        self._seed = 0 if seed is None else seed
        self._epoch = 0

    # ---- seeding (IMAGE-SEED) -------------------------------------------------------------
    def for_pass(self, seed: int, epoch: int) -> MediaTransform:
        """A copy for one pass: the dataset's ``seed`` (unless the transform has its own) and ``epoch``."""
        bound = copy.copy(self)
        bound._seed = seed if self.seed is None else self.seed
        bound._epoch = int(epoch)
        return bound

    def rng(self, key: Any) -> random.Random:
        """The random stream of the sample keyed ``key`` in this pass."""
        return sample_rng(self._seed, self._epoch, key)

    # ---- which fields ----------------------------------------------------------------------
    def takes(self, name: str) -> bool:
        """Whether the sample field ``name`` is one this transform decodes."""
        if self.field is not None:
            return name == self.field
        return name[:2] != "__" and name[name.rfind(".") + 1:].lower() in self.EXTENSIONS

    # ---- use -------------------------------------------------------------------------------
    def __call__(self, value: Any) -> Any:
        """A sample dict with its media fields decoded; bytes or a binary file decoded alone
        (keyed by the digest of the bytes; a file by its name)."""
        if isinstance(value, dict):
            out = dict(value)
            for name, field_value in value.items():
                if self.takes(name):
                    out[name] = self.sample_value(field_value, value, name)
            return out
        key = value if isinstance(value, (bytes, bytearray, memoryview)) else getattr(value, "name", "")
        try:
            return self.decode(media_source(value), self.rng(key), None)
        except Exception as exc:
            error = named_error(exc, None, None)
            if error is exc:
                raise
            raise error from exc

    def sample_value(self, value: Any, sample: dict, name: str | None = None) -> Any:
        """One field of ``sample`` decoded, keyed by the sample (IMAGE-SEED); a failure is our
        error naming the field, the sample's key and its URL."""
        key: Any = sample_key(sample)
        if key is None:
            key = value if isinstance(value, (bytes, bytearray, memoryview)) else ""
        try:
            return self.decode(media_source(value), self.rng(key), name)
        except Exception as exc:
            error = named_error(exc, sample, name)
            if error is exc:
                raise
            raise error from exc

    def decode(self, source: BinaryIO, rng: random.Random, name: str | None) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"sd.{self.KIND}.{type(self).__name__}({args})"
