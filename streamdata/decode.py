"""Decoding by extension, reusing webdataset's handlers so a WebDataset decode spec works unchanged.

``decode=True`` (the default) decodes ``npy``, ``json``, ``txt``, ``cls``/``index`` (int),
``pth`` and the other basic extensions, and images to ``torch.uint8`` tensors laid out
``[C, H, W]`` in RGB (webdataset's ``"torchrgb8"``).  A string is a webdataset image spec
(``"torchrgb"``, ``"pil"``, ``"rgb8"``...), a callable or a list of them are webdataset
handlers ``f(key, data) -> value | None``; ``decode=False`` keeps raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Union

from .errors import DecodeError

__all__ = ["DecodeSpec", "make_decoder"]

DecodeSpec = Union[bool, str, Callable[..., Any], Sequence[Union[str, Callable[..., Any]]], None]
DEFAULT_IMAGE_SPEC = "torchrgb8"


class _Decode:
    """A picklable callable: webdataset Decoder + our DecodeError naming shard URL and key."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder

    def __call__(self, sample: dict) -> dict:
        try:
            return self.decoder(sample)
        except Exception as exc:
            cause = exc.__cause__ or exc
            field = getattr(exc, "k", None)
            url, key = sample.get("__url__"), sample.get("__key__")
            raise DecodeError(
                f"cannot decode field {field!r} of sample {key!r} in {url}: "
                f"{type(cause).__name__}: {cause}", url=url, key=key) from cause


def make_decoder(spec: DecodeSpec) -> Callable[[dict], dict] | None:
    """Build the per-sample decode function for ``spec`` (``None`` when nothing is decoded)."""
    if spec is False or spec is None or spec == "raw":
        return None
    from webdataset import autodecode

    if spec is True:
        items: list = [DEFAULT_IMAGE_SPEC]
    elif isinstance(spec, autodecode.Decoder):
        return _Decode(spec)
    elif isinstance(spec, str) or callable(spec):
        items = [spec]
    else:
        items = list(spec)
    handlers = []
    for item in items:
        if isinstance(item, str):
            if item not in autodecode.imagespecs:
                from .errors import SpecError

                raise SpecError(f"unknown image spec {item!r}; one of {sorted(autodecode.imagespecs)}")
            handlers.append(autodecode.ImageHandler(item))
        elif callable(item):
            handlers.append(item)
        else:
            from .errors import SpecError

            raise SpecError(f"decode items must be image specs or handler callables, got {item!r}")
    return _Decode(autodecode.Decoder(handlers))
