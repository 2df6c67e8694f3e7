"""A small sharded tar writer for ``streamdata convert`` (WebDataset layout, any fsspec URL).

Samples (``{"__key__": k, "jpg": bytes, ...}``) go into ``pattern % n`` shards of at most
``maxcount`` samples and about ``maxsize`` bytes (a new shard starts when either is reached,
as webdataset's ``ShardWriter`` does). A shard is built in memory and uploaded whole in the
background (at most ``uploads`` at once, so memory stays at a few shards): one PUT on object
stores, a temporary file renamed into place on local disks, so no partial shard ever has a
final name. The byte offset where each sample starts is kept for the sample index.
"""

from __future__ import annotations

import concurrent.futures
import io
import posixpath
import tarfile
import time
from typing import Any

from ..backends import close_filesystem, filesystem, translate_error
from ..errors import StreamDataError
from ..urls import split_url

__all__ = ["TarShards"]


class TarShards:
    """Write samples to tar shards at ``pattern`` (``"s3://bkt/train-%06d.tar"``)."""

    def __init__(self, pattern: str, *, maxcount: int = 10000, maxsize: int = 1 << 30,
                 storage_options: dict | None = None, uploads: int = 4) -> None:
        self.pattern, self.maxcount, self.maxsize = pattern, maxcount, maxsize
        self.protocol = split_url(pattern)[0]
        self.fs = filesystem(self.protocol, storage_options)
        self.pool = concurrent.futures.ThreadPoolExecutor(uploads, thread_name_prefix="streamdata-upload")
        self.pending: list[concurrent.futures.Future] = []
        self.uploads = uploads
        self.shards: list[tuple[str, int, int, list[int]]] = []  # url, size, samples, offsets
        self.mtime = time.time()
        self._tar: tarfile.TarFile | None = None
        self._buf: io.BytesIO | None = None
        self._offsets: list[int] = []

    def write(self, sample: dict) -> None:
        if self._tar is not None and (len(self._offsets) >= self.maxcount
                                      or self._buf.tell() >= self.maxsize):
            self._finish()
        if self._tar is None:
            self._buf = io.BytesIO()
            self._tar = tarfile.open(fileobj=self._buf, mode="w", format=tarfile.GNU_FORMAT)
        key = sample["__key__"]
        self._offsets.append(self._tar.offset)
        for field, value in sample.items():
            if field.startswith("__"):
                continue
            data = value if isinstance(value, bytes) else str(value).encode("utf-8")
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size, info.mode, info.mtime = len(data), 0o444, self.mtime
            self._tar.addfile(info, io.BytesIO(data))

    def _finish(self) -> None:
        tar, buf, offsets = self._tar, self._buf, self._offsets
        self._tar, self._buf, self._offsets = None, None, []
        offsets.append(tar.offset)  # where the end-of-archive marker starts
        tar.close()
        url = self.pattern % len(self.shards)
        data = buf.getvalue()
        self.shards.append((url, len(data), len(offsets) - 1, offsets))
        while len([f for f in self.pending if not f.done()]) >= self.uploads:
            concurrent.futures.wait(self.pending, timeout=60, return_when=concurrent.futures.FIRST_COMPLETED)
        self._raise_failed()
        self.pending.append(self.pool.submit(self._upload, url, data))

    def _upload(self, url: str, data: bytes) -> None:
        path = split_url(url)[1]
        try:
            if self.protocol == "file":
                self.fs.makedirs(posixpath.dirname(path) or ".", exist_ok=True)
                self.fs.pipe_file(path + ".partial", data)
                self.fs.mv(path + ".partial", path)
            else:
                self.fs.pipe_file(path, data)  # one PUT: the object appears whole or not at all
        except StreamDataError:
            raise
        except Exception as exc:
            raise translate_error(exc, url, "write") from None

    def _raise_failed(self) -> None:
        for future in self.pending:
            if future.done() and future.exception() is not None:
                raise future.exception()

    def close(self) -> None:
        """Finish the open shard, wait for every upload; raise the first failure."""
        try:
            if self._tar is not None:
                self._finish()
            for future in self.pending:
                future.result(timeout=600)
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            close_filesystem(self.fs)

    def __enter__(self) -> TarShards:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
