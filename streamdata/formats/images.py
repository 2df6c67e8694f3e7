"""Images decoded only as far as a transform needs: the fast image path.

A transform here (:class:`RandomResizedCrop`, :class:`CenterCrop`, :class:`Resize`) takes an
image's encoded bytes and gives the ``torch.uint8 [3, H, W]`` RGB tensor the standard
augmentation gives, without a full-size RGB copy in between: the crop is sampled from the
image's header (its size), a JPEG is decoded at the smallest DCT scale that still holds the
crop at the output size (libjpeg-turbo's scaled decode through ``simplejpeg`` when installed,
else Pillow's ``draft``), and only the crop's pixels are resized, antialiased, by torch's
uint8 kernel. PNG, WebP and the other formats Pillow reads are decoded in full, then take the
same crop and resize. The pixels differ from a full decode then resize only by resampling
(``tests/formats/test_images.py`` holds them to a PSNR of at least 30 dB).

Seeded (IMAGE-SEED): a sample's crop and flip are a function of ``(seed, epoch, key)`` alone:
the seed is the transform's own or the dataset's, the epoch the pass's (``for_pass``, which
the datasets call at the start of each pass), the key the sample's ``__key__`` and
``__url__``, or a Parquet / Arrow row's object, unit and row (``formats.image_columns``; a bare
value with no key, such as an image cell outside a dataset, is keyed by the digest of its
bytes), so the same sample gets the same crop in every run, on every world size and after a
resume.

Use one as ``decode=`` of a tar or object dataset (the image fields take the fast path, the
others are decoded as ``decode=True`` decodes them), as ``map=`` over samples whose image
fields are still bytes (or already decoded arrays: cropped the slow way), as ``decode=`` of a
Parquet or Arrow dataset (its Hugging Face image columns, ``struct<bytes, path>``, found by
type) or a ``decoders=`` entry for one column, or call it on bytes. A corrupt or truncated
image is a :class:`~streamdata.errors.DecodeError` naming the sample's key and URL (skipped and
counted under ``on_error="skip"``).

``decode_on="device"``: the worker reads only a JPEG's header, draws the same box and flip
(IMAGE-SEED: the same crops as the CPU path), and gives an :class:`EncodedImage` (the bytes,
the box, the flip, the output size); collation gathers those into one ``EncodedBatch`` in the
batch's shared memory (``batch/encoded.py``), and the loader's device step decodes, crops,
resizes and flips them there (``feed/images.py``: nvJPEG on a GPU). An image the device does
not take (PNG, WebP, CMYK JPEG...) is finished here on the CPU and travels as pixels.
"""

from __future__ import annotations

import copy
import io
import math
import random
import warnings
from collections.abc import Sequence
from typing import Any

from streamdata.errors import DecodeError, SpecError
from streamdata.formats.seeding import for_pass, sample_key, sample_rng

__all__ = ["DECODE_ON", "IMAGE_FIELDS", "CenterCrop", "EncodedImage", "ImageTransform", "RandomResizedCrop",
           "Resize", "finish_decoded", "for_pass", "jpeg_layout", "sample_key", "sample_rng"]

# a sample's fields taken as images (by extension; the rest are left to the other decoders)
IMAGE_FIELDS = frozenset({"bmp", "gif", "jpeg", "jpg", "pbm", "pgm", "png", "pnm", "ppm", "tif", "tiff",
                          "webp"})
_JPEG_MAGIC = b"\xff\xd8\xff"
_JPEG_END = b"\xff\xd9"
_END_WITHIN = 1024  # a JPEG's end marker is looked for in its last bytes (trailing padding allowed)
# JPEG colour spaces and subsamplings the device decoders take (simplejpeg's header names)
_DEVICE_COLOURS = frozenset({"YCbCr", "Gray"})
_DEVICE_SUBSAMPLINGS = frozenset({"Gray", "420", "422", "444", "440", "411", "441"})
DECODE_ON = ("worker", "device")  # where an image transform decodes: the CPU path, or the loader's device
SCALE_MARGIN = 1.5  # a JPEG is decoded at 1/2, 1/4, 1/8 only where its crop stays this much larger
Box = tuple[int, int, int, int]  # x, y, width, height in the image's full-size pixels


def _pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    """``(height, width)`` from an int or a pair."""
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise SpecError(f"{what} must be a positive int or (height, width), got {size!r}")
    return int(pair[0]), int(pair[1])


class ImageTransform:
    """One image augmentation, decoded only as far as it needs (see the module's notes).

    Subclasses say where the crop lies (:meth:`box`) and what size comes out (:meth:`out_size`).
    ``field``: the sample's field to transform (default: every field whose extension is an
    image format); ``seed``: the crop's seed (default: the dataset's); ``flip``: a horizontal
    flip with probability 1/2."""

    def __init__(self, *, flip: bool = False, field: str | None = None, seed: int | None = None,
                 decode_on: str = "worker") -> None:
        if decode_on not in DECODE_ON:
            raise SpecError(f"decode_on must be one of {DECODE_ON}, got {decode_on!r}")
        self.flip, self.field, self.seed, self.decode_on = bool(flip), field, seed, decode_on
        self._seed = 0 if seed is None else seed
        self._epoch = 0

    # ---- what a transform says ------------------------------------------------------------
    def box(self, width: int, height: int, rng: random.Random) -> Box:
        raise NotImplementedError

    def out_size(self, box: Box) -> tuple[int, int]:
        """``(height, width)`` of the result for a crop ``box``."""
        raise NotImplementedError

    # ---- seeding (IMAGE-SEED) ---------------------------------------------------------------
    def for_pass(self, seed: int, epoch: int) -> ImageTransform:
        """A copy for one pass: the dataset's ``seed`` (unless the transform has its own) and ``epoch``."""
        bound = copy.copy(self)
        bound._seed = seed if self.seed is None else self.seed
        bound._epoch = int(epoch)
        return bound

    # ---- use ------------------------------------------------------------------------------
    def __call__(self, value: Any) -> Any:
        """A sample dict with its image fields transformed; a Hugging Face image cell
        (``{"bytes": ..., "path": ...}``) or bytes as a tensor."""
        if isinstance(value, dict) and not _is_image_cell(value):
            out = dict(value)
            for name, field_value in value.items():
                if self._is_image_field(name):
                    try:
                        out[name] = self.sample_image(field_value, value)
                    except DecodeError as exc:
                        raise _named(exc, value, name) from exc.__cause__
            return out
        return self.image(value)

    def sample_image(self, value: Any, sample: dict) -> Any:
        """:meth:`image` of one field of ``sample``, keyed by the sample (IMAGE-SEED); an
        :class:`EncodedImage` carries the sample's ``__key__`` and ``__url__`` to the device."""
        out = self.image(value, key=sample_key(sample))
        if isinstance(out, EncodedImage):
            out.key, out.url = (_text(sample.get(name)) for name in ("__key__", "__url__"))
        return out

    def takes(self, name: str) -> bool:
        """Whether the sample field ``name`` is one this transform decodes."""
        return self._is_image_field(name)

    def _is_image_field(self, name: str) -> bool:
        if self.field is not None:
            return name == self.field
        return name[:2] != "__" and name[name.rfind(".") + 1:].lower() in IMAGE_FIELDS

    def image(self, value: Any, key: Any = None) -> Any:
        """One image (encoded bytes, a Hugging Face cell, or an already decoded ``[C, H, W]``
        tensor / ``H x W x C`` array) -> ``torch.uint8 [3, H, W]``."""
        if isinstance(value, dict):
            path = value.get("path")
            value = value.get("bytes")
            if value is None:
                raise DecodeError(f"the image cell has no bytes (path {path!r}): only embedded "
                                  "images can be decoded", key=path)
        rng = sample_rng(self._seed, self._epoch, key if key is not None else value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            try:
                return self._decoded(bytes(value), rng)
            except DecodeError:
                raise
            except Exception as exc:
                raise DecodeError(f"cannot decode image: {type(exc).__name__}: {exc}") from exc
        return self._from_array(value, rng)

    def _decoded(self, data: bytes, rng: random.Random) -> Any:
        if self.decode_on == "device":
            return _encoded(data, self, rng)
        return self._decoded_here(data, rng)

    def _decoded_here(self, data: bytes, rng: random.Random) -> Any:
        """The CPU path: decoded (as far as the crop needs), cropped, resized, flipped."""
        if data[:3] == _JPEG_MAGIC:
            decoded = _decode_jpeg(data, self, rng)
            if decoded is not None:
                return _finish(*decoded, self, rng)
        return _finish(*_decode_pillow(data, self, rng), self, rng)

    def _from_array(self, value: Any, rng: random.Random) -> Any:
        """The slow path: an image decoded before (``decode=True``'s ``[3, H, W]`` tensor, or
        an ``H x W x 3`` array) cropped and resized the same way."""
        import numpy as np
        import torch

        if isinstance(value, torch.Tensor):
            if value.ndim != 3 or value.dtype != torch.uint8:
                raise DecodeError(f"expected a uint8 [C, H, W] image, got {value.dtype} {tuple(value.shape)}")
            hwc = value.permute(1, 2, 0).numpy()
        elif isinstance(value, np.ndarray) and value.ndim == 3 and value.dtype == np.uint8:
            hwc = value
        else:
            raise DecodeError(f"expected image bytes or a uint8 image, got {type(value).__name__}")
        if hwc.shape[2] == 1:
            hwc = np.repeat(hwc, 3, axis=2)
        hwc = hwc[:, :, :3]
        h, w = hwc.shape[:2]
        box = self.box(w, h, rng)
        return _finish(hwc, box, 1.0, 1.0, self, rng)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"sd.images.{type(self).__name__}({args})"


class RandomResizedCrop(ImageTransform):
    """A crop of random area (``scale``, a fraction of the image's) and aspect (``ratio``,
    sampled on a log scale) resized to ``size``, as torchvision samples it: ten tries, then
    the centre crop clamped to ``ratio``; ``flip=True`` (the default here) mirrors half."""

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, flip: bool = True, field: str | None = None,
                 seed: int | None = None, decode_on: str = "worker") -> None:
        super().__init__(flip=flip, field=field, seed=seed, decode_on=decode_on)
        self.size = _pair(size, "size")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        if not (0 < self.scale[0] <= self.scale[1]) or not (0 < self.ratio[0] <= self.ratio[1]):
            raise SpecError(f"scale and ratio must be increasing positive pairs, got {scale!r}, {ratio!r}")

    def box(self, width: int, height: int, rng: random.Random) -> Box:
        return random_resized_box(width, height, self.scale, self.ratio, rng)

    def out_size(self, box: Box) -> tuple[int, int]:
        return self.size


def random_resized_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                       rng: random.Random) -> Box:
    """torchvision's ``RandomResizedCrop.get_params``, on ``rng``: ``(x, y, w, h)``."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            y = rng.randint(0, height - h)
            x = rng.randint(0, width - w)
            return x, y, w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


class CenterCrop(ImageTransform):
    """The centre ``size`` crop; with ``resize``, of the image first resized so that its shorter
    side is ``resize`` (the usual evaluation transform, ``resize=256`` then 224), done as one
    crop of the full image and one resize."""

    def __init__(self, size: int | Sequence[int], *, resize: int | None = None, flip: bool = False,
                 field: str | None = None, seed: int | None = None, decode_on: str = "worker") -> None:
        super().__init__(flip=flip, field=field, seed=seed, decode_on=decode_on)
        self.size = _pair(size, "size")
        if resize is not None and (not isinstance(resize, int) or resize <= 0):
            raise SpecError(f"resize must be a positive int (the shorter side), got {resize!r}")
        self.resize = resize

    def box(self, width: int, height: int, rng: random.Random) -> Box:
        th, tw = self.size
        k = 1.0 if self.resize is None else min(width, height) / self.resize  # source px per output px
        w, h = min(width, int(round(tw * k))), min(height, int(round(th * k)))
        return (width - w) // 2, (height - h) // 2, max(w, 1), max(h, 1)

    def out_size(self, box: Box) -> tuple[int, int]:
        if self.resize is None:
            return box[3], box[2]  # a plain crop: its own pixels (smaller when the image is)
        return self.size


class Resize(ImageTransform):
    """The whole image resized: ``size`` an int sets the shorter side (aspect kept), a pair
    ``(height, width)`` sets both."""

    def __init__(self, size: int | Sequence[int], *, flip: bool = False, field: str | None = None,
                 seed: int | None = None, decode_on: str = "worker") -> None:
        super().__init__(flip=flip, field=field, seed=seed, decode_on=decode_on)
        if isinstance(size, int):
            if size <= 0:
                raise SpecError(f"size must be positive, got {size!r}")
            self.size: int | tuple[int, int] = size
        else:
            self.size = _pair(size, "size")

    def box(self, width: int, height: int, rng: random.Random) -> Box:
        return 0, 0, width, height

    def out_size(self, box: Box) -> tuple[int, int]:
        if not isinstance(self.size, int):
            return self.size
        w, h = box[2], box[3]
        if w <= h:
            return int(round(h * self.size / w)), self.size
        return self.size, int(round(w * self.size / h))


# ---- decoding ---------------------------------------------------------------------------------

def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _dct_factor(box: Box, oh: int, ow: int) -> int:
    """DCT-SCALE: the JPEG's scale-down for a crop ``box`` resized to ``oh x ow``: 1, 2, 4 or 8, the
    largest that leaves the crop ``SCALE_MARGIN`` times the output's size. Only powers of two:
    libjpeg-turbo's other factors (7/8, 3/4...) decode no faster here, and a margin below 1.5
    costs sharpness (PSNR under 30 dB against a full decode, ``benchmarks/images.py``)."""
    factor = 1
    while factor < 8 and min(box[2] / ow, box[3] / oh) >= 2 * factor * SCALE_MARGIN:
        factor *= 2
    return factor


def _decode_jpeg(data: bytes, t: ImageTransform, rng: random.Random) -> tuple[Any, Box, float, float] | None:
    """libjpeg-turbo's scaled decode (``simplejpeg``): the smallest scale whose crop still has
    the output's size. None: not installed, or a JPEG it does not read (CMYK...): Pillow's."""
    sj = _simplejpeg()
    if sj is None:
        return None
    try:
        height, width, _, colour = sj.decode_jpeg_header(data)
    except ValueError:
        return None
    if colour not in ("Gray", "420", "422", "444", "440", "411", "441"):
        return None
    box = t.box(width, height, rng)
    oh, ow = t.out_size(box)
    factor = _dct_factor(box, oh, ow)
    hwc = sj.decode_jpeg(data, colorspace="RGB", min_height=math.ceil(height / factor),
                         min_width=math.ceil(width / factor))
    return hwc, box, hwc.shape[1] / width, hwc.shape[0] / height


def _decode_pillow(data: bytes, t: ImageTransform, rng: random.Random) -> tuple[Any, Box, float, float]:
    """Pillow: a JPEG at the scale ``draft`` allows, anything else in full, as ``H x W x 3``."""
    import numpy as np
    import PIL.Image

    with io.BytesIO(data) as stream:
        image: Any = PIL.Image.open(stream)
        width, height = image.size
        box = t.box(width, height, rng)
        if image.format == "JPEG":
            factor = _dct_factor(box, *t.out_size(box))
            if factor > 1:
                image.draft("RGB", (width // factor, height // factor))
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
        hwc = np.asarray(image)
    return hwc, box, hwc.shape[1] / width, hwc.shape[0] / height


def _finish(hwc: Any, box: Box, fx: float, fy: float, t: ImageTransform, rng: random.Random) -> Any:
    """The crop ``box`` (full-size pixels; the decoded image is ``fx``, ``fy`` of full size)
    of ``hwc`` resized to the transform's output, flipped when drawn: ``uint8 [3, H, W]``."""
    flip = t.flip and rng.random() < 0.5  # drawn after the box (the same order on every path)
    x, y, w, h = box
    x0, y0 = int(round(x * fx)), int(round(y * fy))
    x1 = max(x0 + 1, min(hwc.shape[1], int(round((x + w) * fx))))
    y1 = max(y0 + 1, min(hwc.shape[0], int(round((y + h) * fy))))
    region = _tensor(hwc[y0:y1, x0:x1]).permute(2, 0, 1)  # [3, h, w] view, channels last
    return finish_decoded(region, (0, 0, x1 - x0, y1 - y0), flip, t.out_size(box)).contiguous()


def _tensor(array: Any) -> Any:
    """A tensor view of ``array`` (Pillow's arrays are read-only: the view is only read)."""
    import torch

    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


# ---- decoded on the device ---------------------------------------------------------------------

class EncodedImage:
    """One image on its way to the device (``decode_on="device"``): the JPEG's bytes with the
    crop ``box`` (full-size pixels), the ``flip`` and the output ``size`` (height, width) the
    CPU path would have drawn for it (IMAGE-SEED); or, for an image the device does not take,
    the CPU path's finished ``uint8 [3, H, W]`` ``pixels``. ``key`` and ``url`` name its sample
    in errors."""

    __slots__ = ("box", "data", "flip", "key", "pixels", "size", "url")

    def __init__(self, data: bytes | None, box: Box, flip: bool, size: tuple[int, int],
                 pixels: Any = None, key: str | None = None, url: str | None = None) -> None:
        self.data, self.box, self.flip, self.size, self.pixels = data, box, flip, size, pixels
        self.key, self.url = key, url

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for name, value in zip(self.__slots__, state, strict=True):
            setattr(self, name, value)

    def __repr__(self) -> str:
        what = "pixels" if self.data is None else f"{len(self.data)} JPEG bytes"
        return f"EncodedImage({what}, box={self.box}, flip={self.flip}, size={self.size}, key={self.key!r})"


def jpeg_layout(data: bytes) -> tuple[int, int, str, str] | None:
    """``(width, height, colour space, subsampling)`` from a JPEG's header, nothing decoded
    (simplejpeg's names; Pillow's modes mapped to them, its subsampling unknown: ``"?"``);
    ``None`` for bytes that are not a JPEG. A header that does not parse is a :class:`DecodeError`."""
    if data[:3] != _JPEG_MAGIC:
        return None
    sj = _simplejpeg()
    if sj is not None:
        try:
            height, width, colour, subsampling = sj.decode_jpeg_header(data)
        except ValueError as exc:
            raise DecodeError(f"cannot read the JPEG header: {exc}") from exc
        return width, height, colour, subsampling
    import PIL.Image

    try:
        with io.BytesIO(data) as stream, PIL.Image.open(stream) as image:  # reads the header only
            width, height = image.size
            colour = {"L": "Gray", "RGB": "YCbCr"}.get(image.mode, image.mode)
    except Exception as exc:
        raise DecodeError(f"cannot read the JPEG header: {type(exc).__name__}: {exc}") from exc
    return width, height, colour, "Gray" if colour == "Gray" else "?"


def _encoded(data: bytes, t: ImageTransform, rng: random.Random) -> EncodedImage:
    """``decode_on="device"`` in the worker: a JPEG the device takes leaves encoded, with the box
    and flip drawn as the CPU path draws them (box, then flip); any other image is finished here
    by the CPU path and travels as pixels. A JPEG cut short (no end marker) is refused here, where
    ``on_error="skip"`` can count it, rather than on the device."""
    layout = jpeg_layout(data)
    if (layout is None or layout[2] not in _DEVICE_COLOURS
            or layout[3] not in _DEVICE_SUBSAMPLINGS | {"?"}):
        pixels = t._decoded_here(data, rng)  # the CPU path, its own box and flip
        size = (int(pixels.shape[1]), int(pixels.shape[2]))
        return EncodedImage(None, (0, 0, size[1], size[0]), False, size, pixels)
    if _JPEG_END not in data[-_END_WITHIN:]:
        raise DecodeError(f"the JPEG is truncated: {len(data)} bytes and no end marker")
    width, height = layout[:2]
    box = t.box(width, height, rng)
    size = t.out_size(box)
    flip = t.flip and rng.random() < 0.5  # drawn after the box, as in _finish
    return EncodedImage(data, box, bool(flip), size)


def finish_decoded(chw: Any, box: Box, flip: bool, size: tuple[int, int]) -> Any:
    """The crop, resize and flip of one decoded image, on both paths: ``chw`` a
    ``uint8 [3, H, W]`` tensor on any device (the box in its pixels), the result
    ``uint8 [3, *size]`` there (a view where neither resize nor flip applies). On the CPU
    torch's ``uint8`` antialiased kernel; elsewhere the same filter in ``float32``, rounded."""
    import torch

    x, y, w, h = box
    region = chw[:, y:y + h, x:x + w]
    oh, ow = size
    if tuple(region.shape[1:]) != (oh, ow):
        if region.device.type == "cpu":
            region = torch.nn.functional.interpolate(region[None], size=(oh, ow), mode="bilinear",
                                                     antialias=True, align_corners=False)[0]
        else:
            scaled = torch.nn.functional.interpolate(region[None].float(), size=(oh, ow), mode="bilinear",
                                                     antialias=True, align_corners=False)[0]
            region = scaled.round_().clamp_(0, 255).to(torch.uint8)
    return region.flip(-1) if flip else region


# ---- naming -----------------------------------------------------------------------------------

def _is_image_cell(value: dict) -> bool:
    """A Hugging Face ``Image`` feature's value: ``{"bytes": ..., "path": ...}``."""
    return "bytes" in value and set(value) <= {"bytes", "path"}


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _named(exc: DecodeError, sample: dict, field: str) -> DecodeError:
    url, key = _text(sample.get("__url__")), _text(sample.get("__key__"))
    return DecodeError(f"cannot decode image field {field!r} of sample {key!r} in {url}: {exc}",
                       url=url, key=key)

