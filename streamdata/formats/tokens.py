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

A loss mask beside ``NAME.bin`` (flat or Megatron) is ``NAME.mask.bin``: one ``uint8`` per
token, in the same order (1: a token to train on, 0: one not to); ``NAME.idx`` describes both.
"""

from __future__ import annotations

import io
import json
import struct
from typing import NamedTuple

import numpy as np
from numpy.lib import format as npy

from streamdata.errors import FormatError, SpecError
from streamdata.formats.tar import sample_offsets, samples_from_chunks
from streamdata.redact import redact_url

__all__ = ["COUNTS_FORMAT", "IDX_MAGIC", "MegatronIndex", "TarCounts", "decode_tar_counts",
           "encode_tar_counts", "idx_bytes", "npy_tokens", "parse_idx", "tar_token_counts", "tar_tokens",
           "MASK_SUFFIX", "mask_of", "token_dtype", "tokens_of"]

IDX_MAGIC = b"MMIDIDX\x00\x00"
MASK_SUFFIX = ".mask.bin"  # a .bin's loss mask, beside it: NAME.mask.bin for NAME.bin
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


def mask_of(data: bytes | bytearray | memoryview | np.ndarray, url: str, expected: int) -> np.ndarray:
    """``expected`` loss-mask bytes (uint8) from ``data``; a short read or a value other than 0
    and 1 (not a mask: another file, or one out of step with its tokens) is a FormatError."""
    values = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data
    if len(values) != expected:
        raise FormatError(f"{redact_url(url)} holds {len(values)} loss-mask bytes where {expected} were "
                          "expected (one uint8 per token of its .bin: truncated, or written for other "
                          "tokens?)", url=url, key="mask")
    if len(values) and (int(values.max()) > 1 or int(values.min()) < 0):
        bad = int(values.max()) if int(values.max()) > 1 else int(values.min())
        raise FormatError(f"{redact_url(url)}: a loss mask holds 0 and 1 only, found {bad} "
                          "(is it the mask, one uint8 per token?)", url=url, key="mask")
    return values.astype(np.uint8, copy=False)


# ---- tar shards with a 1-D integer .npy field per sample (WebDataset style) ----------------


def _npy_header(data: bytes, url: str, key: str) -> tuple[np.dtype, int, int]:
    """A sample's ``.npy`` field: its dtype, token count and where its data starts; a
    FormatError naming the shard and the sample unless it is a 1-D integer array."""
    name = redact_url(url)

    def bad(what: str) -> FormatError:
        return FormatError(f"{name}: sample {key!r} holds {what}, not a 1-D integer .npy of token ids "
                           "(write each sample's tokens with np.save(f, np.asarray(ids, np.uint32)))",
                           url=url, key=key)

    f = io.BytesIO(data)
    try:
        version = npy.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = npy.read_array_header_2_0(f)
        else:
            raise ValueError(f"npy format version {version}")
    except ValueError as exc:
        raise bad(f"no readable .npy ({exc})") from None
    if dtype.kind not in _TOKEN_KINDS or dtype.hasobject:
        raise bad(f"{dtype} values")
    if len(shape) != 1:
        raise bad(f"an array of shape {shape}")
    start = f.tell()
    if len(data) - start != shape[0] * dtype.itemsize:
        raise bad(f"{len(data) - start} data bytes where its header says {shape[0]} {dtype} values "
                  "(truncated?)")
    return dtype, int(shape[0]), start


def npy_tokens(data: bytes, url: str, key: str) -> np.ndarray:
    """A sample's ``.npy`` field's token ids (1-D, integer), without a copy."""
    dtype, n, start = _npy_header(data, url, key)
    return np.frombuffer(data, dtype, n, start)


def _field(sample: dict, field: str, url: str) -> bytes:
    data = sample.get(field)
    if data is None:
        raise FormatError(f"{redact_url(url)}: sample {sample['__key__']!r} has no field {field!r} "
                          f"(it has {sorted(k for k in sample if not k.startswith('__'))}); every sample "
                          "of a token tar holds its tokens in that field", url=url, key=sample["__key__"])
    return data


def tar_token_counts(data: bytes, url: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """A whole tar shard's samples: the tokens in each one's ``field`` (from the ``.npy`` headers)
    and the ``samples + 1`` byte offsets of the samples (``tar.sample_offsets``)."""
    offsets = np.asarray(sample_offsets([data], url, total=len(data)), dtype=np.int64)
    counts = [_npy_header(_field(s, field, url), url, s["__key__"])[1]
              for s in samples_from_chunks([data], url, total=len(data))]
    if len(counts) != len(offsets) - 1:  # (both follow group_samples: never, unless a bug)
        raise FormatError(f"{redact_url(url)}: {len(counts)} samples but {len(offsets) - 1} offsets", url=url)
    return np.asarray(counts, dtype=np.int64), offsets


def tar_tokens(data: bytes, url: str, field: str, counts: np.ndarray) -> np.ndarray:
    """The tokens of consecutive samples (the bytes of a span of them, ``tar_token_counts``'s
    offsets) laid back to back, checked against their ``counts``."""
    arrays = [npy_tokens(_field(s, field, url), url, s["__key__"])
              for s in samples_from_chunks([data], url, accept_unterminated=True)]
    got = [len(a) for a in arrays]
    if got != [int(n) for n in counts]:
        raise FormatError(f"{redact_url(url)} changed after its tokens were counted: samples of "
                          f"{got[:8]} tokens where the count said {counts[:8].tolist()}", url=url, key=field)
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)


# ---- a tar corpus's counts, kept between jobs --------------------------------------------------

COUNTS_FORMAT = "streamdata-token-counts"


class TarCounts(NamedTuple):
    """A tar shard's counting pass: its name (relative to the counts file's directory, or a URL),
    size and ETag when counted, tokens per sample, and the samples' ``samples + 1`` offsets."""

    name: str
    size: int
    etag: str | None
    counts: np.ndarray
    offsets: np.ndarray


def encode_tar_counts(field: str, entries: list[TarCounts]) -> bytes:
    """A counts file (an ``.npz`` without pickles): a JSON header (format, version, field, each
    shard's name, size, ETag, samples), then every shard's counts and offsets, concatenated."""
    header = {"format": COUNTS_FORMAT, "version": 1, "field": field,
              "shards": [{"name": e.name, "size": int(e.size), "etag": e.etag, "samples": len(e.counts)}
                         for e in entries]}
    out = io.BytesIO()
    np.savez(out, header=np.frombuffer(json.dumps(header).encode(), np.uint8),
             counts=np.concatenate([e.counts for e in entries] or [np.zeros(0)]).astype("<i8"),
             offsets=np.concatenate([e.offsets for e in entries] or [np.zeros(0)]).astype("<i8"))
    return out.getvalue()


def decode_tar_counts(data: bytes, url: str) -> tuple[str, list[TarCounts]]:
    """The field and entries of a counts file; anything malformed is a FormatError naming it."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            header = json.loads(z["header"].tobytes())
            counts, offsets = z["counts"], z["offsets"]
        if header["format"] != COUNTS_FORMAT or header["version"] != 1:
            raise ValueError(f"format {header['format']!r} version {header['version']!r}")
        shards = header["shards"]
        samples = [int(sh["samples"]) for sh in shards]
        if len(counts) != sum(samples) or len(offsets) != sum(samples) + len(samples):
            raise ValueError("arrays shorter or longer than the header says")
        entries, a, b = [], 0, 0
        for sh, n in zip(shards, samples, strict=True):
            entries.append(TarCounts(str(sh["name"]), int(sh["size"]), sh["etag"], counts[a:a + n],
                                     offsets[b:b + n + 1]))
            a, b = a + n, b + n + 1
        return str(header["field"]), entries
    except (ValueError, KeyError, TypeError, OSError, EOFError) as exc:
        raise FormatError(f"{redact_url(url)} is not a usable token counts file ({type(exc).__name__}: "
                          f"{exc}): delete it and save the counts again", url=url) from None
