"""Token files: bytes -> token arrays. Flat ``.bin`` arrays (nanoGPT-style) and the Megatron
``.idx`` index beside a ``.bin`` (its own reader, from the published layout), checked against
each other. Pure parsing, no I/O: every malformed input is a FormatError naming the URL.

Megatron's ``.idx`` (``MMIDIDX``, version 1), little-endian:

    9 bytes  b"MMIDIDX\\x00\\x00"
    u64      version (1)
    u8       dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    u64      sequence count S
    u64      document count D
    i32[S]   tokens per sequence
    i64[S]   byte offset of each sequence in the .bin
    i64[D]   document boundaries, as sequence indices
    (i8[S]   sequence modes: multimodal indexes only, ignored)

A Megatron "sequence" is one tokenized document (or one sentence of it); streamdata's documents
are these sequences, which the ``.bin`` holds back to back.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from streamdata.errors import FormatError, SpecError
from streamdata.redact import redact_url

__all__ = ["IDX_MAGIC", "MegatronIndex", "idx_bytes", "parse_idx", "token_dtype", "tokens_of"]

IDX_MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")
IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
              7: np.float32, 8: np.uint16}
_TOKEN_KINDS = "ui"  # token ids are integers


def token_dtype(dtype: object, where: str = "dtype") -> np.dtype:
    """A token dtype (``"uint16"``, ``np.uint32``, ...), little-endian; SpecError for anything
    that is not an integer type."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise SpecError(f"{where}: {dtype!r} is not a numpy dtype; tokens are e.g. 'uint16' or "
                        "'uint32'") from exc
    if dt.kind not in _TOKEN_KINDS:
        raise SpecError(f"{where}: tokens must be an integer dtype (e.g. 'uint16', 'uint32'), got {dt}")
    return dt.newbyteorder("<")


class MegatronIndex(NamedTuple):
    """What a ``.idx`` says of its ``.bin``: the token dtype and each document's tokens."""

    dtype: np.dtype
    lengths: np.ndarray  # int64, tokens per document (Megatron's sequences)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def parse_idx(data: bytes, url: str, bin_url: str, bin_size: int | None) -> MegatronIndex:
    """A Megatron ``.idx``'s documents, checked against its ``.bin`` (``bin_size`` bytes): the
    documents must lie back to back from byte 0 and end where the ``.bin`` ends."""
    name = redact_url(url)

    def bad(what: str) -> FormatError:
        return FormatError(f"{name} is not a usable Megatron index: {what}; rebuild it "
                           "(Megatron's preprocess_data.py) or read the .bin flat with dtype=", url=url,
                           key="idx")

    if len(data) < _HEAD.size:
        raise bad(f"{len(data)} bytes, shorter than its {_HEAD.size}-byte header")
    magic, version, code, seqs, docs = _HEAD.unpack_from(data)
    if magic != IDX_MAGIC:
        raise bad(f"its header starts {magic!r}, not {IDX_MAGIC!r}")
    if version != 1:
        raise bad(f"index version {version} (this reader knows version 1)")
    if code not in IDX_DTYPES or np.dtype(IDX_DTYPES[code]).kind not in _TOKEN_KINDS:
        raise bad(f"dtype code {code} is not an integer token type")
    need = _HEAD.size + seqs * 12 + docs * 8
    if len(data) < need:
        raise bad(f"{len(data)} bytes where its counts ({seqs} sequences, {docs} documents) need {need}")
    dtype = np.dtype(IDX_DTYPES[code]).newbyteorder("<")
    lengths = np.frombuffer(data, np.dtype("<i4"), seqs, _HEAD.size).astype(np.int64)
    pointers = np.frombuffer(data, np.dtype("<i8"), seqs, _HEAD.size + seqs * 4)
    if seqs and (lengths < 0).any():
        raise bad("a negative sequence length")
    expected = np.concatenate([[0], np.cumsum(lengths[:-1]) * dtype.itemsize]) if seqs else lengths
    if not np.array_equal(pointers, expected):
        raise bad("its sequences do not lie back to back from byte 0 of the .bin")
    total = int(lengths.sum()) * dtype.itemsize
    if bin_size is not None and total != bin_size:
        raise FormatError(f"{name} does not match its .bin {redact_url(bin_url)}: the index holds "
                          f"{total} bytes of {dtype} tokens, the .bin has {bin_size} bytes; the two "
                          "were not written together: rebuild the pair", url=bin_url, key="idx")
    return MegatronIndex(dtype, lengths)


def idx_bytes(lengths: list[int] | np.ndarray, dtype: object = np.uint16) -> bytes:
    """A Megatron ``.idx`` for documents of ``lengths`` tokens (one document per sequence):
    what ``streamdata.write`` and tests produce beside a ``.bin``."""
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    code = {np.dtype(v): k for k, v in IDX_DTYPES.items()}[dt]
    lens = np.asarray(lengths, dtype=np.int64)
    pointers = np.concatenate([[0], np.cumsum(lens[:-1]) * dt.itemsize]).astype("<i8") if len(lens) else lens
    return b"".join([_HEAD.pack(IDX_MAGIC, 1, code, len(lens), len(lens) + 1), lens.astype("<i4").tobytes(),
                     pointers.astype("<i8").tobytes(), np.arange(len(lens) + 1, dtype="<i8").tobytes()])


def tokens_of(data: bytes | bytearray | memoryview, dtype: np.dtype, url: str, expected: int) -> np.ndarray:
    """``expected`` tokens from ``data``; a short read (a truncated ``.bin``) is a FormatError."""
    n = len(data) // dtype.itemsize
    if n != expected or len(data) % dtype.itemsize:
        raise FormatError(f"{redact_url(url)} is shorter than its listing or index says: {len(data)} "
                          f"bytes where {expected} {dtype} tokens were expected (truncated or "
                          "rewritten while read?)", url=url, key="bin")
    return np.frombuffer(data, dtype, n)
