"""Per-sample random streams for transforms bound to a pass (IMAGE-SEED and the media clips).

A transform that draws at random (an image crop, a video clip, an audio segment) takes its
numbers from :func:`sample_rng`, a stream that is a function of the pass's ``seed`` and
``epoch`` and the sample's key (:func:`sample_key`) only: the same sample gets the same draw in
every run, on every world size, after any resume, whichever worker decodes it. The dataset
binds its ``map`` and decoders to each pass with :func:`for_pass`.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

__all__ = ["for_pass", "sample_key", "sample_rng"]


def for_pass(fn: Any, seed: int, epoch: int) -> Any:
    """``fn`` bound to a pass's ``seed`` and ``epoch`` when it takes them (its ``for_pass``
    method), else ``fn``."""
    bind = getattr(fn, "for_pass", None)
    return fn if bind is None else bind(seed, epoch)


def sample_rng(seed: int, epoch: int, key: Any) -> random.Random:
    """The random stream of one sample in one epoch: ``key`` is a string or the sample's bytes
    (hashed)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{seed}\x00{epoch}\x00".encode())
    h.update(key if isinstance(key, (bytes, bytearray, memoryview)) else str(key).encode())
    return random.Random(int.from_bytes(h.digest(), "little"))


def sample_key(sample: dict) -> str | None:
    """The sample's key for its random stream: ``__key__`` and the shard's name (not its whole URL:
    the same shard read from another endpoint or through a proxy gets the same draws)."""
    key, url = sample.get("__key__"), sample.get("__url__")
    if key is None:
        return None
    key, url = _text(key), _text(url)
    shard = str(url).rstrip("/").rsplit("/", 1)[-1] if url is not None else ""
    return f"{shard}\x00{key}"


def _text(value: Any) -> str | None:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
