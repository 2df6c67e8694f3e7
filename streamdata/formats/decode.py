"""Decoding by extension, reusing webdataset's handlers so a WebDataset decode spec works unchanged.

``decode=True`` (the default) decodes ``npy``, ``json``, ``txt``, ``cls``/``index`` (int),
``pth`` and the other basic extensions, and images to ``torch.uint8`` tensors laid out
``[C, H, W]`` in RGB (webdataset's ``"torchrgb8"``).  A string is a webdataset image spec
(``"torchrgb"``, ``"pil"``, ``"rgb8"``...), a callable or a list of them are webdataset
handlers ``f(key, data) -> value | None``; ``decode=False`` keeps raw bytes. An image transform
(``sd.images.RandomResizedCrop(224)``, :mod:`streamdata.formats.images`) decodes image fields
only as far as it needs, the other fields as ``decode=True`` does; so does a video or audio
transform (``sd.video.RandomClip(16)``, ``sd.audio.RandomSegment(2.0)``,
:mod:`streamdata.formats.media`) for its media fields, and a list of such transforms for each's.

``decode=True`` does not import webdataset (LAZY-DECODERS): ``npy``, the ints and texts,
``json``/``jsn`` and the common image formats are decoded here, to the values webdataset's
handlers give; a field of any other extension (``pth``, ``pyd``, ``npz``, ``.gz``, an image
format not listed in ``IMAGE_EXTENSIONS``, one of ours that declines a field such as an unusual
``.npy``) goes to webdataset's decoder, built the first time a process meets one. The
constructor then imports neither webdataset nor yaml, and a worker imports them only for data
that needs them.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from streamdata.errors import DecodeError
from streamdata.formats.images import ImageTransform
from streamdata.formats.media import MediaTransform
from streamdata.metrics import StageClock, modality_acc

__all__ = ["IMAGE_EXTENSIONS", "DecodeSpec", "fast_basic", "fast_image", "fast_json", "fast_npy",
           "make_decoder"]

DecodeSpec = bool | str | Callable[..., Any] | Sequence[str | Callable[..., Any]] | None
FieldTransform = ImageTransform | MediaTransform  # a transform of the fields it ``takes``
DEFAULT_IMAGE_SPEC = "torchrgb8"
# decoded here under ``decode=True`` (each is in webdataset's own list; the rest go to it)
IMAGE_EXTENSIONS = frozenset({"bmp", "gif", "jpeg", "jpg", "pbm", "pgm", "png", "pnm", "ppm", "tif",
                              "tiff", "webp"})


_NPY_MAGIC = b"\x93NUMPY"
_npy_headers: dict[bytes, tuple[Any, tuple[int, ...], bool]] = {}


def fast_npy(key: str, data: bytes) -> Any:
    """A webdataset handler for ``.npy`` that parses each distinct header once.

    numpy's own loader runs ``ast.literal_eval`` on every array's header, which costs more
    than the copy of a 100 KB array; shards repeat one header, so it is cached here.
    Returns ``None`` (letting the basic handlers decide) for anything unusual.
    """
    if not key.lower().endswith(".npy") or data[:6] != _NPY_MAGIC:
        return None
    import numpy as np

    size = 2 if data[6] == 1 else 4
    start = 8 + size
    end = start + int.from_bytes(data[8:start], "little")
    header = bytes(data[start:end])
    parsed = _npy_headers.get(header)
    if parsed is None:
        import ast

        meta = ast.literal_eval(header.decode("latin1"))
        parsed = (np.dtype(meta["descr"]), tuple(meta["shape"]), bool(meta["fortran_order"]))
        if parsed[0].hasobject:
            return None
        if len(_npy_headers) < 1024:
            _npy_headers[header] = parsed
    dtype, shape, fortran = parsed
    count = 1
    for n in shape:
        count *= n
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=end)
    # one copy makes it writable (torch.from_numpy and user code expect that)
    return flat.reshape(shape[::-1]).T.copy() if fortran else flat.reshape(shape).copy()


_BASIC: dict[str, Callable[[bytes], Any]] = {
    "cls": int, "cls2": int, "index": int, "inx": int, "id": int,
          "txt": lambda d: d.decode("utf-8"), "text": lambda d: d.decode("utf-8")}


def fast_basic(key: str, data: bytes) -> Any:
    """Ints and text without webdataset's per-field regex (the same results, cheaper)."""
    convert = _BASIC.get(key[key.rfind(".") + 1:].lower())
    return None if convert is None else convert(data)


def fast_json(key: str, data: bytes) -> Any:
    """``.json`` and ``.jsn`` (exactly those names, as webdataset's basic handlers match them)."""
    return json.loads(data) if key[key.rfind(".") + 1:] in ("json", "jsn") else None


def fast_image(key: str, data: bytes) -> Any:
    """An image of a common format as a ``torch.uint8`` tensor ``[3, H, W]``, RGB: the value
    webdataset's ``"torchrgb8"`` handler gives, without importing webdataset."""
    if key[key.rfind(".") + 1:].lower() not in IMAGE_EXTENSIONS:
        return None
    import numpy as np
    import PIL.Image
    import torch

    with io.BytesIO(data) as stream:
        image = PIL.Image.open(stream)
        image.load()
        rgb = np.asarray(image.convert("RGB"))  # H x W x 3
    return torch.from_numpy(rgb.transpose(2, 0, 1).copy())


_OURS = (fast_npy, fast_basic, fast_json, fast_image)


class _Default:
    """``decode=True`` (LAZY-DECODERS): our handlers first, webdataset's decoder for the rest,
    imported the first time a field needs it. Picklable; a field's failure is a DecodeError
    naming the field, the sample's key and its URL. With ``transforms`` (``decode=`` an image
    transform, :mod:`streamdata.formats.images`, a video or audio one,
    :mod:`streamdata.formats.media`, or a list of them), each field one of them takes goes
    through the first that takes it."""

    def __init__(self, transforms: Sequence[FieldTransform] = ()) -> None:
        self._rest: Any = None  # webdataset's Decoder, made on first need in this process
        self._transforms = tuple(transforms)

    def __getstate__(self) -> dict:
        return {"_rest": None, "_transforms": self._transforms}

    def for_pass(self, seed: int, epoch: int) -> _Default:
        """This decoder with its transforms bound to the pass (IMAGE-SEED)."""
        if not self._transforms:
            return self
        bound = _Default([t.for_pass(seed, epoch) for t in self._transforms])
        bound._rest = self._rest
        return bound

    def __call__(self, sample: dict) -> dict:
        out = {}
        acc = modality_acc()  # a pass's clock while its reader's thread decodes: each field timed
        for field, value in sample.items():
            if field[:2] == "__":  # __key__, __url__...: text, as webdataset gives them
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        pass
                out[field] = value
                continue
            transform = next((t for t in self._transforms if t.takes(field)), None)
            if acc is None:
                out[field] = self._one(field, value, sample, transform)
                continue
            slot = _slot(field, transform)
            if slot is None:
                out[field] = self._one(field, value, sample, transform)
                continue
            began = time.perf_counter_ns()
            try:
                out[field] = self._one(field, value, sample, transform)
            finally:
                acc[slot] += time.perf_counter_ns() - began
        return out

    def _one(self, field: str, value: Any, sample: dict, transform: FieldTransform | None) -> Any:
        if transform is not None and isinstance(value, (bytes, io.IOBase)):  # a file: ranged reads
            if isinstance(transform, MediaTransform):  # names its own errors (a FormatError when corrupt)
                return transform.sample_value(value, sample, field)
            try:
                return transform.sample_image(value, sample)
            except Exception as exc:
                raise _decode_error(sample, field, exc) from exc
        try:
            return self._field(field, value)
        except Exception as exc:
            raise _decode_error(sample, field, exc) from exc

    def _field(self, field: str, value: Any) -> Any:
        if not isinstance(value, bytes):
            raise TypeError(f"expected bytes, got {type(value).__name__}")
        key = "." + field
        for handler in _OURS:
            result = handler(key, value)
            if result is not None:
                return result
        if self._rest is None:
            from webdataset import autodecode

            # what decode=True was before: a ``.gz`` field, unzipped, meets our handlers again
            image = autodecode.ImageHandler(DEFAULT_IMAGE_SPEC)
            self._rest = autodecode.Decoder([fast_npy, fast_basic, image])
        return self._rest.decode1(field, value)


def _slot(field: str, transform: FieldTransform | None) -> int | None:
    """The clock's slot a field's decoding time adds to (``metrics.MODALITIES``), or None."""
    if isinstance(transform, MediaTransform):
        return StageClock.MODALITY.get(transform.KIND)
    if transform is not None or field[field.rfind(".") + 1:].lower() in IMAGE_EXTENSIONS:
        return StageClock.IMAGE
    return None


def _decode_error(sample: dict, field: Any, cause: BaseException) -> DecodeError:
    url, key = sample.get("__url__"), sample.get("__key__")
    return DecodeError(f"cannot decode field {field!r} of sample {key!r} in {url}: "
                       f"{type(cause).__name__}: {cause}", url=url, key=key)


class _Decode:
    """A picklable callable: webdataset Decoder + our DecodeError naming shard URL and key."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def __call__(self, sample: dict) -> dict:
        try:
            return self.decoder(sample)
        except Exception as exc:
            cause = exc.__cause__ or exc
            raise _decode_error(sample, getattr(exc, "k", None), cause) from cause


def make_decoder(spec: DecodeSpec) -> Callable[[dict], dict] | None:
    """Build the per-sample decode function for ``spec`` (``None`` when nothing is decoded)."""
    if spec is False or spec is None or spec == "raw":
        return None
    if spec is True:
        return _Default()
    if isinstance(spec, (ImageTransform, MediaTransform)):  # its fields its way, decode=True's for the rest
        return _Default([spec])
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(t, (ImageTransform, MediaTransform))
                                                        for t in spec):
        return _Default(spec)
    from webdataset import autodecode

    if isinstance(spec, autodecode.Decoder):
        return _Decode(spec)
    elif isinstance(spec, str) or callable(spec):
        items = [spec]
    else:
        items = list(spec)
    handlers: list = [item for item in items if callable(item)]  # the user's own go first
    handlers += [fast_npy, fast_basic]
    for item in items:
        if isinstance(item, str):
            if item not in autodecode.imagespecs:
                from streamdata.errors import SpecError

                raise SpecError(f"unknown image spec {item!r}; one of {sorted(autodecode.imagespecs)}")
            handlers.append(autodecode.ImageHandler(item))
        elif not callable(item):
            from streamdata.errors import SpecError

            raise SpecError(f"decode items must be image specs or handler callables, got {item!r}")
    return _Decode(autodecode.Decoder(handlers))
