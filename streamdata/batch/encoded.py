"""A batch of images still encoded (``decode_on="device"``): one fixed layout in shared memory.

The worker's :class:`~streamdata.formats.images.EncodedImage` records are gathered here, at
collation, into an :class:`EncodedBatch`: every image's bytes end to end in one ``uint8``
tensor (``data``, image ``i`` at ``offsets[i]:offsets[i + 1]``), and per image its crop box,
flip, output size and kind (``JPEG``: bytes to decode; ``PIXELS``: an image the worker
finished on the CPU, its ``uint8 [3, H, W]`` pixels stored in the same place). Its tensors are
allocated as every batch tensor is (the worker's shared memory, recycled storage), so the batch
crosses to the main process by handle and is pinned like any other (it is a dataclass: the
batch walkers see its tensors). The loader's device step turns it into ``uint8 [B, 3, H, W]``
on the device (``feed/images.py``); ``keys`` and ``urls`` name each image in its errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from streamdata.batch.tree import pin_batch
from streamdata.errors import DecodeError
from streamdata.formats.images import EncodedImage

__all__ = ["JPEG", "PIXELS", "EncodedBatch", "gather"]

JPEG, PIXELS = 0, 1  # kinds: bytes for the device to decode; pixels the worker finished


@dataclasses.dataclass
class EncodedBatch:
    """Images to finish on the device; ``len()`` is the batch size. See the module's notes."""

    data: torch.Tensor  # uint8 [total bytes]
    offsets: torch.Tensor  # int64 [B + 1]
    boxes: torch.Tensor  # int32 [B, 4]: x, y, width, height in the image's full-size pixels
    flips: torch.Tensor  # bool [B]
    sizes: torch.Tensor  # int32 [B, 2]: output height, width
    kinds: torch.Tensor  # uint8 [B]: JPEG or PIXELS
    keys: list[str | None]
    urls: list[str | None]

    def __len__(self) -> int:
        return len(self.kinds)

    def pin_memory(self) -> EncodedBatch:
        """This batch with its tensors page-locked (DataLoader's ``pin_memory`` calls it)."""
        return pin_batch(self)

    def name(self, i: int) -> str:
        """Image ``i`` as errors name it: its sample's key and shard URL."""
        return f"sample {self.keys[i]!r} in {self.urls[i]}"


def gather(images: Sequence[EncodedImage], path: str,
           empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]) -> EncodedBatch:
    """One :class:`EncodedBatch` of ``images`` (``path`` names the field in errors); ``empty``
    allocates each tensor (``shape, dtype`` -> tensor: the collation's shared-memory one)."""
    if not all(isinstance(image, EncodedImage) for image in images):
        odd = next(type(image).__name__ for image in images if not isinstance(image, EncodedImage))
        raise DecodeError(f"cannot collate {path}: a mix of images for the device and {odd}")
    n = len(images)
    sizes = [image.size for image in images]
    for i, size in enumerate(sizes):
        if size != sizes[0]:
            raise DecodeError(f"cannot collate {path}: sample 0 comes out {sizes[0]}, sample {i} "
                              f"{size} (a fixed output size, or batch them yourself)")
    lengths = [len(image.data) if image.data is not None else image.pixels.numel() for image in images]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    batch = EncodedBatch(empty((int(offsets[-1]),), torch.uint8), empty((n + 1,), torch.int64),
                         empty((n, 4), torch.int32), empty((n,), torch.bool), empty((n, 2), torch.int32),
                         empty((n,), torch.uint8), [image.key for image in images],
                         [image.url for image in images])
    data = batch.data.numpy()
    for i, image in enumerate(images):
        start, end = int(offsets[i]), int(offsets[i + 1])
        if image.data is not None:
            data[start:end] = np.frombuffer(image.data, dtype=np.uint8)
        else:
            data[start:end] = image.pixels.reshape(-1).numpy()
    batch.offsets.numpy()[:] = offsets
    batch.boxes.numpy()[:] = np.asarray([image.box for image in images], dtype=np.int32).reshape(n, 4)
    batch.flips.numpy()[:] = [image.flip for image in images]
    batch.sizes.numpy()[:] = np.asarray(sizes, dtype=np.int32).reshape(n, 2)
    batch.kinds.numpy()[:] = [JPEG if image.data is not None else PIXELS for image in images]
    return batch
