"""Seeded fuzzing of the readers: mutated tar shards (webdataset's TarWriter, pax headers) and
mutated Parquet files, read through TarDataset / ParquetDataset from local files.

Each case runs under a time limit (SIGALRM in the main thread, raising ``Hang``, a
BaseException no policy catches), so a parser loop that stops consuming input (TAR-PROGRESS)
fails the test instead of hanging the suite.  The only outcomes allowed are records or one of
our errors (``sd.StreamDataError``).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import random
import re
import signal
import struct
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import streamdata as sd
from tests.helpers import make_samples, tar_bytes

CASE_LIMIT_S = 10.0  # a case takes milliseconds; this only catches a loop that never ends
BLOCK = 512


class Hang(BaseException):
    """A case ran past its time limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum, frame):
        raise Hang(f"no result within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- tar mutations ----------------------------------------------------------------------------


def valid_tar() -> bytes:
    """Six samples of three members each, every member after a pax header (float mtimes)."""
    return tar_bytes(make_samples([6], floats=100)[0])


def headers(data: bytes) -> list[tuple[int, bytes]]:
    """``(offset, type)`` of every header block of a valid tar (pax headers included)."""
    out, at = [], 0
    while at + BLOCK <= len(data) and data[at:at + BLOCK].count(0) != BLOCK:
        size = int(data[at + 124:at + 136].split(b"\0")[0] or b"0", 8)
        out.append((at, data[at + 156:at + 157]))
        at += BLOCK + (size + BLOCK - 1) // BLOCK * BLOCK
    return out


def with_checksum(header: bytearray) -> bytearray:
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return header


def edit_header(data: bytes, at: int, field: slice, value: bytes, fix_checksum: bool = True) -> bytes:
    header = bytearray(data[at:at + BLOCK])
    header[field] = value.ljust(field.stop - field.start, b"\0")[:field.stop - field.start]
    if fix_checksum:
        with_checksum(header)
    return data[:at] + bytes(header) + data[at + BLOCK:]


def ext_header(kind: bytes, payload: bytes, size: int | None = None) -> bytes:
    """An extended header block (``L`` or ``x``) and its padded payload."""
    header = bytearray(BLOCK)
    header[0:13] = b"././@LongLink"
    header[100:108] = b"0000644\0"
    header[124:136] = b"%011o\0" % (len(payload) if size is None else size)
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    return bytes(with_checksum(header)) + payload + bytes(-len(payload) % BLOCK)


PAX_RECORDS = [b"00 path=x\n", b"0 path=x\n", b"0", b"5 x=\n", b"99999999999999999999 path=a\n",
               b"ab path=x\n", b"12 path=abc", b"9 pathabc\n", b"7 =abc\n", b"10 size=-1\n",
               b"11 size=abc\n", b"30 size=99999999999999999999\n", b"18 path=\xff\xfe.txt\n",
               b"-5 path=x\n", b"3 \n", b" 7 a=b\n", b"13 path=a.txt\n\0\0\0"]
SIZE_FIELDS = [b"\x80" + (1 << 80).to_bytes(11, "big")[1:], b"\xff" * 12, b"\xff" + b"\x00" * 11,
               b"\x80" + bytes(10) + b"\x05", b"77777777777\0", b"-0000000001\0", b"0x10\0",
               b"+1\0", b"1_0\0", b"        \0", b"99999999\0", b"\0" * 12]


def bit_flips(data: bytes, rng: random.Random) -> bytes:
    """``data`` with 1 to 8 random bits flipped."""
    flips = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        flips[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    return bytes(flips)


def tar_mutation(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """One random mutation of ``data``: ``(description, mutated bytes)``."""
    marks = headers(data)
    at, kind = rng.choice(marks)
    pax = [a for a, k in marks if k == b"x"]
    n = len(data)
    choice = rng.randrange(12)
    if choice == 0:
        return "bit flips", bit_flips(data, rng)
    if choice == 1:
        start, length = rng.randrange(n), rng.randint(1, 600)
        fill = bytes([rng.randrange(256)]) * length if rng.random() < 0.5 else rng.randbytes(length)
        return f"byte run at {start}", data[:start] + fill + data[start + length:]
    if choice == 2:
        cut = rng.choice([rng.randrange(n), rng.choice(marks)[0], rng.randrange(n // BLOCK) * BLOCK])
        return f"truncated at {cut}", data[:cut]
    if choice == 3:
        where = rng.randrange(n)
        return f"insert at {where}", data[:where] + rng.randbytes(rng.randint(1, 700)) + data[where:]
    if choice == 4:
        where = rng.randrange(n)
        return f"delete at {where}", data[:where] + data[where + rng.randint(1, 700):]
    if choice == 5:
        value = rng.choice(SIZE_FIELDS)
        return f"size {value!r} at {at}", edit_header(data, at, slice(124, 136), value)
    if choice == 6:
        value = rng.choice(SIZE_FIELDS)
        return f"size {value!r} at {at}, stale checksum", edit_header(data, at, slice(124, 136), value, False)
    if choice == 7:  # replace a pax header's records
        where = rng.choice(pax)
        records = rng.choice(PAX_RECORDS)
        old = int(data[where + 124:where + 135], 8)
        block = ext_header(b"x", records)
        return f"pax {records!r} at {where}", (data[:where] + block
                                                + data[where + BLOCK + (old + BLOCK - 1) // BLOCK * BLOCK:])
    if choice == 8:  # a pax header whose size field lies about its records
        where = rng.choice(pax)
        value = b"%011o\0" % rng.choice([0, 1, 5, 600, 1 << 21, (1 << 33) - 1])
        return f"pax size {value!r} at {where}", edit_header(data, where, slice(124, 136), value)
    if choice == 9:  # a GNU long-name record before a member
        payload = rng.choice([b"k.txt\0", b"\xe9t\xe9.txt\0", b"", rng.randbytes(rng.randint(1, 1200)),
                              b"a" * 5000 + b".txt\0"])
        size = rng.choice([None, None, 0, 3, 1 << 40, 1 << 21])
        block = ext_header(b"L", payload, size)
        return f"long name {payload[:20]!r} (size {size}) at {at}", data[:at] + block + data[at:]
    if choice == 10:
        value = rng.choice([b"0000000\0", b"\0" * 8, b"zzzzzz\0 ", b"%06o\0 " % rng.randrange(1 << 18)])
        return f"checksum {value!r} at {at}", edit_header(data, at, slice(148, 156), value, False)
    value = rng.choice([b"1", b"2", b"5", b"L", b"x", b"g", b"K", b"S", b"\0", b"Z"])
    return f"type {value!r} at {at}", edit_header(data, at, slice(156, 157), value)


def targeted_tar_cases(data: bytes) -> Iterator[tuple[str, bytes]]:
    """Every listed pax record, size field and long name once, and a cut at every block."""
    marks = headers(data)
    pax_at = [a for a, k in marks if k == b"x"][1]
    member_at = [a for a, k in marks if k == b"0"][1]
    pax_len = BLOCK + (int(data[pax_at + 124:pax_at + 135], 8) + BLOCK - 1) // BLOCK * BLOCK
    for records in PAX_RECORDS:
        yield f"pax {records!r}", data[:pax_at] + ext_header(b"x", records) + data[pax_at + pax_len:]
    for value in SIZE_FIELDS:
        yield f"size {value!r}", edit_header(data, member_at, slice(124, 136), value)
        yield f"pax size {value!r}", edit_header(data, pax_at, slice(124, 136), value)
    for payload, size in [(b"\xe9t\xe9.txt\0", None), (b"", None), (b"k.txt\0", (1 << 33) - 1),
                          (b"a" * 5000 + b".txt\0", None), (b"k.txt", 1 << 21)]:
        block = ext_header(b"L", payload, size)
        yield f"long name {payload[:20]!r} (size {size})", data[:member_at] + block + data[member_at:]
    for cut in range(0, len(data), BLOCK):
        yield f"truncated at {cut}", data[:cut]


def random_cases(data: bytes, mutate: Callable, cases: int, seed: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    for case in range(cases):
        what, mutated = mutate(data, rng)
        yield f"case {case} (seed {seed}, {what})", mutated


# ---- Parquet mutations ------------------------------------------------------------------------


def valid_parquet() -> bytes:
    rows = 60
    table = pa.table({"text": [f"row {i} é" for i in range(rows)], "n": list(range(rows)),
                      "x": [i / 3 for i in range(rows)],
                      "seq": [list(range(i % 5)) for i in range(rows)]})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=20)
    return buf.getvalue()


def valid_arrow(stream: bool) -> bytes:
    """An Arrow IPC file (or stream) of 3 record batches: strings, ints, lists, a dictionary."""
    rows = 60
    table = pa.table({"text": [f"row {i} é" * (i % 4) for i in range(rows)], "n": list(range(rows)),
                      "seq": pa.array([[i] * (i % 4) for i in range(rows)], pa.list_(pa.int32())),
                      "tag": pa.array(["a", "b", "c"] * (rows // 3)).dictionary_encode()})
    buf = io.BytesIO()
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(buf, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=20):
            writer.write_batch(batch)
    return buf.getvalue()


def parquet_mutation(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    n = len(data)
    choice = rng.randrange(6)
    if choice == 0:
        return "bit flips", bit_flips(data, rng)
    if choice == 1:
        start, length = rng.randrange(n), rng.randint(1, 64)
        return f"byte run at {start}", data[:start] + rng.randbytes(length) + data[start + length:]
    if choice == 2:
        cut = rng.randrange(n)
        return f"truncated at {cut}", data[:cut]
    if choice == 3:
        where = rng.randrange(n)
        return f"insert at {where}", data[:where] + rng.randbytes(rng.randint(1, 64)) + data[where:]
    if choice == 4:
        where = rng.randrange(n)
        return f"delete at {where}", data[:where] + data[where + rng.randint(1, 64):]
    start = rng.randrange(max(1, n - 200), n - 8)  # the footer: schema, offsets, sizes
    flips = bytearray(data)
    flips[start] = rng.randrange(256)
    return f"footer byte {start}", bytes(flips)


# ---- the driver -------------------------------------------------------------------------------


def read_tar(path: str) -> None:
    for _ in sd.TarDataset(path, accept_unterminated=random.random() < 0.3):
        pass


def read_parquet(path: str) -> None:
    for _ in sd.ParquetDataset(path, batch_size=16):
        pass
    for _ in sd.ParquetDataset(path, columns=["text", "seq"]):
        pass


def read_arrow(path: str) -> None:
    for _ in sd.ArrowDataset(path, batch_size=7):
        pass
    for _ in sd.ArrowDataset(path):
        pass


def tar_error_names_url_and_offset(exc: sd.StreamDataError, url: str) -> None:
    if isinstance(exc, sd.FormatError) and "duplicate member" not in str(exc):
        assert exc.url == url and re.search(rf"tar {re.escape(url)}: .*at byte \d+", str(exc)), str(exc)


def fuzz(tmp_path: Path, name: str, cases: Iterable[tuple[str, bytes]], read: Callable[[str], None],
         check: Callable[[sd.StreamDataError, str], None] | None = None) -> None:
    """Read each ``(description, bytes)`` case; fail on a hang, or listing the cases whose
    error was not ours."""
    random.seed(name)  # read_tar's choice of accept_unterminated
    path = tmp_path / name
    failures: list[str] = []
    ok = errors = 0
    for what, data in cases:
        path.write_bytes(data)
        try:
            with time_limit(CASE_LIMIT_S):
                read(str(path))
            ok += 1
        except sd.StreamDataError as exc:
            errors += 1
            if check is not None:
                check(exc, str(path))
        except Hang:
            pytest.fail(f"{what} hung: no result within {CASE_LIMIT_S} s")
        except Exception as exc:  # an error that is not ours escaped
            tb = "".join(traceback.format_exception(exc)[-3:])
            failures.append(f"{what}: {type(exc).__name__}: {exc}\n{tb}")
    assert not failures, (f"{len(failures)} of {ok + errors + len(failures)} cases raised an error "
                          "not ours:\n" + "\n".join(failures[:5]))
    assert ok and errors  # the cases do break things, and not everything


@pytest.mark.slow
def test_mutated_tar_ends_in_samples_or_our_error(tmp_path):
    valid = valid_tar()
    cases = itertools.chain(targeted_tar_cases(valid), random_cases(valid, tar_mutation, 200, seed=1))
    fuzz(tmp_path, "m.tar", cases, read_tar, check=tar_error_names_url_and_offset)


def test_mutated_parquet_ends_in_rows_or_our_error(tmp_path):
    fuzz(tmp_path, "m.parquet", random_cases(valid_parquet(), parquet_mutation, 60, seed=2), read_parquet)


@pytest.mark.parametrize("stream", [False, True], ids=["file", "stream"])
def test_mutated_arrow_ipc_ends_in_rows_or_our_error(tmp_path, stream):
    """Found by this fuzzing: a batch with corrupt offsets made Arrow's C++ abort the process,
    a footer block past the object's end sent the fetcher after bytes that do not exist (retried
    until the deadline), and non-UTF-8 field names escaped as UnicodeDecodeError."""
    name = "m.arrows" if stream else "m.arrow"
    fuzz(tmp_path, name, random_cases(valid_arrow(stream), parquet_mutation, 80, seed=3), read_arrow)


def ipc_header_mutation(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    """Bytes changed inside one record batch's message header (where its row count is read)."""
    from streamdata.formats.arrow import ipc_batch_meta_ranges

    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    headers = ipc_batch_meta_ranges(data[len(data) - 10 - footer_len:], "x", len(data))
    (start, end), _ = rng.choice(headers)
    at, length = rng.randrange(start, end), rng.choice([1, 1, 2, 4, 8])
    value = bytes([rng.choice([0, 1, 0x7F, 0xFF, rng.randrange(256)]) for _ in range(length)])
    return f"header bytes at {at}", data[:at] + value + data[at + length:]


def test_mutated_ipc_batch_headers_end_in_rows_or_our_error_naming_the_url(tmp_path):
    """The constructor reads each batch's row count from its header: damage there is a
    FormatError naming the object (in the constructor, or as a stale count when read)."""

    def names_url(exc: sd.StreamDataError, url: str) -> None:
        assert isinstance(exc, sd.FormatError) and exc.url == url, repr(exc)

    fuzz(tmp_path, "h.arrow", random_cases(valid_arrow(False), ipc_header_mutation, 40, seed=5),
         read_arrow, check=names_url)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 42))
def test_mutated_ipc_batch_headers_many_more_cases(tmp_path, seed):
    def names_url(exc: sd.StreamDataError, url: str) -> None:
        assert isinstance(exc, sd.FormatError) and exc.url == url, repr(exc)

    fuzz(tmp_path, "h.arrow", random_cases(valid_arrow(False), ipc_header_mutation, 300, seed),
         read_arrow, check=names_url)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10, 14))
def test_mutated_tar_many_more_cases(tmp_path, seed):
    fuzz(tmp_path, "m.tar", random_cases(valid_tar(), tar_mutation, 1500, seed), read_tar,
         check=tar_error_names_url_and_offset)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20, 22))
def test_mutated_parquet_many_more_cases(tmp_path, seed):
    fuzz(tmp_path, "m.parquet", random_cases(valid_parquet(), parquet_mutation, 500, seed), read_parquet)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(30, 32))
def test_mutated_arrow_ipc_many_more_cases(tmp_path, seed):
    for stream in (False, True):
        fuzz(tmp_path, "m.arrows" if stream else "m.arrow",
             random_cases(valid_arrow(stream), parquet_mutation, 300, seed), read_arrow)


def test_invalid_utf8_in_a_parquet_string_column_is_a_decode_error_naming_column_and_url(tmp_path):
    text = pa.array([b"ok", b"caf\xe9", b"x"], pa.binary()).view(pa.string())  # latin-1 bytes
    pq.write_table(pa.table({"text": text, "n": [1, 2, 3]}), tmp_path / "bad.parquet")
    url = str(tmp_path / "bad.parquet")
    for batch_size in (2, None):
        with pytest.raises(sd.DecodeError, match=rf"column 'text' \(string\) of {re.escape(url)} "
                                                 r"cannot be converted: UnicodeDecodeError") as info:
            list(sd.ParquetDataset(url, batch_size=batch_size))
        assert info.value.url == url and info.value.key == "text"
    ds = sd.ParquetDataset(url, batch_size=2, on_error="skip")
    assert [b["n"].tolist() for b in ds] == [[3]] and ds.skipped["decode"] == 1
    assert [b["n"].tolist() for b in sd.ParquetDataset(url, columns=["n"], batch_size=2)] == [[1, 2], [3]]


def test_an_ipc_footer_block_past_the_end_is_a_format_error_at_once(tmp_path):
    """A footer that sends the reader after bytes the object does not have fails in the
    constructor, instead of being fetched (and retried) until the deadline."""
    from streamdata.formats.arrow import ipc_blocks

    data = valid_arrow(stream=False)
    footer_len = struct.unpack_from("<i", data, len(data) - 10)[0]
    footer = data[len(data) - 10 - footer_len:]
    _, batches = ipc_blocks(footer, "x")
    first = struct.pack("<q", batches[0][0])
    at = data.rindex(first)  # the first batch's Block in the footer
    bad = data[:at] + struct.pack("<q", len(data) * 4) + data[at + 8:]
    path = tmp_path / "far.arrow"
    path.write_bytes(bad)
    began = time.monotonic()
    with pytest.raises(sd.FormatError, match="outside the object") as info:
        with time_limit(CASE_LIMIT_S):
            sd.ArrowDataset(str(path))
    assert info.value.url == str(path) and time.monotonic() - began < 5
