"""ImageNet-sized JPEGs cut from scikit-image's sample photographs (a real photo set that ships in
a package): random crops of the colour photos, resized to about 500x375 (either orientation),
saved at quality 90. Deterministic for a seed."""

from __future__ import annotations

import io

import numpy as np

__all__ = ["jpeg_photos", "source_photos"]

# scikit-image's colour photographs (skimage.data), each a few hundred pixels to 1.4k a side
_NAMES = ("astronaut", "chelsea", "coffee", "rocket", "motorcycle_left", "hubble_deep_field",
          "retina", "immunohistochemistry", "colorwheel", "cat", "motorcycle_right")


def source_photos() -> list[np.ndarray]:
    """The colour photographs of ``skimage.data`` as ``H x W x 3`` uint8 arrays."""
    import skimage.data

    photos = []
    for name in _NAMES:
        fn = getattr(skimage.data, name, None)
        if fn is None:
            continue
        try:
            image = fn()
        except Exception:  # a photo that needs a download (pooch) is left out
            continue
        if isinstance(image, tuple):
            image = image[0]
        if image.ndim == 3 and image.shape[2] >= 3 and min(image.shape[:2]) >= 200:
            photos.append(np.ascontiguousarray(image[:, :, :3]))
    return photos


def jpeg_photos(count: int, *, seed: int = 0, quality: int = 90, fmt: str = "JPEG") -> list[bytes]:
    """``count`` encoded images of about 500x375 (landscape or portrait), each a random crop of one
    of the source photographs (at least half of its shorter side) resized with Pillow."""
    import PIL.Image

    rng = np.random.default_rng(seed)
    photos = [PIL.Image.fromarray(p) for p in source_photos()]
    out = []
    for i in range(count):
        photo = photos[i % len(photos)]
        w, h = photo.size
        side = int(min(w, h) * rng.uniform(0.5, 1.0))
        cw, ch = min(w, int(side * 4 / 3)), side
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        size = (500, 375) if rng.random() < 0.75 else (375, 500)
        crop = photo.crop((x, y, x + cw, y + ch)).resize(size, PIL.Image.BILINEAR)
        if rng.random() < 0.5:
            crop = crop.transpose(PIL.Image.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        crop.save(buf, fmt, quality=quality)
        out.append(buf.getvalue())
    return out
