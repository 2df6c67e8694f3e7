"""The device step of ``decode_on="device"``: an :class:`~streamdata.batch.encoded.EncodedBatch`
decoded, cropped, resized and flipped on the device the loader feeds, as ``uint8 [B, 3, H, W]``.

The decoder is chosen by the device's type (:func:`decoder_for`; :func:`register_decoder`
replaces one): on ``cuda`` nvJPEG through ``torchvision.io.decode_jpeg(device=...)``, batched,
else nvImageCodec, else a :class:`~streamdata.errors.BackendMissingError` naming what to
install; on ``cpu`` (and any device without a decoder of its own, whose pixels are then
copied there) a full decode by libjpeg-turbo (``simplejpeg``) or Pillow. Every decoder decodes
the whole image; the crop, the antialiased resize and the flip are
:func:`~streamdata.formats.images.finish_decoded`, on the device.

An image the device decoder refuses (the whole batched call fails, or its answer for the image
is missing) is decoded alone, then, if the device refuses it alone too, on the CPU here
(counted in :func:`counts`, ``"cpu_fallback"``); one the CPU cannot decode either is a
:class:`~streamdata.errors.DecodeError` naming its sample's key and shard URL.
"""

from __future__ import annotations

import functools
import io
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from streamdata.batch.encoded import JPEG, EncodedBatch
from streamdata.batch.tree import map_leaves
from streamdata.errors import BackendMissingError, DecodeError
from streamdata.formats.images import finish_decoded

__all__ = ["Decoder", "counts", "decode_on_cpu", "decoder_for", "finish", "finished", "has_encoded",
           "register_decoder"]

# a decoder: JPEG bytes (CPU uint8 tensors, maybe pinned) and the device -> uint8 [3, H, W] per
# image, on that device or the CPU (None for an image it could not decode)
Decoder = Callable[[list[torch.Tensor], torch.device], list[Any]]
_DECODERS: dict[str, Decoder] = {}
_COUNTS = {"cpu_fallback": 0, "device_images": 0}
_LOCK = threading.Lock()


def register_decoder(device_type: str, decoder: Decoder | None) -> None:
    """Use ``decoder`` for devices of ``device_type`` (``None``: the default again)."""
    if decoder is None:
        _DECODERS.pop(device_type, None)
    else:
        _DECODERS[device_type] = decoder


def counts() -> dict[str, int]:
    """This process's images decoded by a device step (``device_images``) and those its device
    decoder refused and the CPU decoded instead (``cpu_fallback``)."""
    return dict(_COUNTS)


def decoder_for(device: torch.device) -> Decoder:
    """The decoder for ``device``: a registered one, else nvJPEG / nvImageCodec on ``cuda``, else
    the CPU's."""
    if device.type in _DECODERS:
        return _DECODERS[device.type]
    if device.type == "cuda":
        return _cuda_decoder()
    return decode_on_cpu


def decode_on_cpu(datas: list[torch.Tensor], device: torch.device) -> list[Any]:
    """Full decodes on the CPU, by what the CPU path decodes JPEGs with: libjpeg-turbo
    (``simplejpeg``) when installed (what it refuses is refused here too), else Pillow."""
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    out = []
    for data in datas:
        raw = data.numpy().tobytes()
        hwc = simplejpeg.decode_jpeg(raw, colorspace="RGB") if simplejpeg is not None else _pillow(raw)
        out.append(torch.from_numpy(np.ascontiguousarray(hwc)).permute(2, 0, 1))
    return out


def _pillow(raw: bytes) -> Any:
    import PIL.Image

    with io.BytesIO(raw) as stream, PIL.Image.open(stream) as image:
        return np.asarray(image.convert("RGB"))


@functools.cache  # found once per process (a decoder missing raises every time, uncached)
def _cuda_decoder() -> Decoder:
    op = _nvjpeg_op()
    if op is not None:
        def nvjpeg(datas: list[torch.Tensor], device: torch.device) -> list[Any]:
            return list(op(datas, _RGB, device))

        return nvjpeg
    try:
        from torchvision.io import ImageReadMode, decode_jpeg  # nvJPEG
    except Exception as tv_exc:  # ImportError, or a torchvision built against another torch
        try:
            from nvidia import nvimgcodec  # type: ignore[import-not-found, unused-ignore]
        except ImportError as nv_exc:
            raise BackendMissingError(
                "decode_on=\"device\" on a CUDA device needs nvJPEG through torchvision (>= 0.19, the "
                "build that matches your torch: pip install torchvision) or nvImageCodec (pip install "
                f"nvidia-nvimgcodec-cu12); neither imports here (torchvision: {type(tv_exc).__name__}: "
                f"{tv_exc}; nvImageCodec: {nv_exc}). Or decode in the workers: decode_on=\"worker\"."
            ) from nv_exc
        return _NvImageCodec(nvimgcodec)

    def torchvision_decode(datas: list[torch.Tensor], device: torch.device) -> list[Any]:
        return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=device))

    return torchvision_decode


_RGB = 3  # torchvision.io.ImageReadMode.RGB


def _nvjpeg_op() -> Callable[..., Any] | None:
    """torchvision's batched nvJPEG operator (``decode_jpegs_cuda``, what
    ``torchvision.io.decode_jpeg(list, device="cuda")`` calls) loaded from its image library alone:
    importing ``torchvision`` itself took 5.3 s of CPU on an H200 machine, the whole of the GPU
    path's first batch, and the decode needs none of it. ``None`` where that library is not
    found or lacks the operator (then :func:`_cuda_decoder` imports ``torchvision.io``)."""
    import importlib.machinery
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("torchvision")
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = os.path.join(folder, "image" + suffix)
                if os.path.isfile(path):
                    torch.ops.load_library(path)
                    return torch.ops.image.decode_jpegs_cuda
    except Exception:  # a torchvision built against another torch, or without this operator
        return None
    return None


class _NvImageCodec:
    """nvImageCodec's batched decoder (HWC on the device, viewed as CHW). Not yet run on a device."""

    def __init__(self, nvimgcodec: Any) -> None:
        self._module = nvimgcodec
        self._decoders: dict[int, Any] = {}  # one decoder per device index

    def __call__(self, datas: list[torch.Tensor], device: torch.device) -> list[Any]:
        index = device.index if device.index is not None else torch.cuda.current_device()
        decoder = self._decoders.get(index)
        if decoder is None:
            decoder = self._decoders[index] = self._module.Decoder(device_id=index)
        images = decoder.decode([data.numpy() for data in datas])
        return [None if image is None else torch.as_tensor(image, device=device).permute(2, 0, 1)
                for image in images]


def has_encoded(batch: Any) -> bool:
    """Whether ``batch`` holds an :class:`EncodedBatch` (in dicts, lists and tuples)."""
    if isinstance(batch, EncodedBatch):
        return True
    if isinstance(batch, dict):
        return any(has_encoded(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return any(has_encoded(value) for value in batch)
    return False


def finished(batch: Any, device: torch.device, move: Callable[[torch.Tensor], Any] | None = None,
             decoder: Decoder | None = None) -> Any:
    """``batch`` with each :class:`EncodedBatch` finished on ``device`` (:func:`finish`) and
    ``move`` applied to its other tensors (the prefetcher's copy; ``None``: left as they are)."""

    def leaf(value: Any) -> Any:
        if isinstance(value, EncodedBatch):
            return finish(value, device, decoder)
        if move is not None and isinstance(value, torch.Tensor):
            return move(value)
        return value

    return map_leaves(leaf, batch, whole=(EncodedBatch,))


def finish(batch: EncodedBatch, device: torch.device | str, decoder: Decoder | None = None) -> torch.Tensor:
    """Decode, crop, resize and flip ``batch``'s images on ``device``: ``uint8 [B, 3, H, W]``."""
    device = torch.device(device)
    decode = decoder if decoder is not None else decoder_for(device)
    n = len(batch)
    offsets = batch.offsets.tolist()
    kinds, flips = batch.kinds.tolist(), batch.flips.tolist()
    boxes, sizes = batch.boxes.tolist(), batch.sizes.tolist()
    oh, ow = sizes[0] if n else (0, 0)
    out = torch.empty((n, 3, oh, ow), dtype=torch.uint8, device=device)
    jpegs = [i for i in range(n) if kinds[i] == JPEG]
    datas = [batch.data[offsets[i]:offsets[i + 1]] for i in jpegs]
    decoded = _decode_all(decode, datas, jpegs, batch, device)
    with _LOCK:
        _COUNTS["device_images"] += len(jpegs)
    for i, image in zip(jpegs, decoded, strict=True):
        out[i] = finish_decoded(image.to(device, non_blocking=True), tuple(boxes[i]), flips[i], (oh, ow))
    for i in range(n):
        if kinds[i] != JPEG:  # finished by the worker: its pixels
            pixels = batch.data[offsets[i]:offsets[i + 1]].view(3, oh, ow)
            out[i] = pixels.to(device, non_blocking=pixels.is_pinned())
    return out


def _decode_all(decode: Decoder, datas: list[torch.Tensor], index: list[int], batch: EncodedBatch,
                device: torch.device) -> list[Any]:
    """``decode`` of every image, batched; an image it refuses: alone, then on the CPU; else a
    DecodeError naming its sample."""
    if not datas:
        return []
    try:
        images: list[Any] = list(decode(datas, device))
    except Exception:
        images = [None] * len(datas)
    if len(images) != len(datas):
        images = [None] * len(datas)
    for j, image in enumerate(images):
        if image is not None:
            continue
        try:
            images[j] = decode([datas[j]], device)[0]
        except Exception:
            images[j] = None
        if images[j] is not None:
            continue
        i = index[j]
        try:
            images[j] = decode_on_cpu([datas[j]], device)[0]
        except Exception as exc:
            raise DecodeError(f"cannot decode the image of {batch.name(i)} on {device}: "
                              f"{type(exc).__name__}: {exc}", url=batch.urls[i], key=batch.keys[i]) from exc
        with _LOCK:
            _COUNTS["cpu_fallback"] += 1
    return images
