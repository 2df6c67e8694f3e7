"""File helpers of the local disk cache (``streamdata.fetch.cache``): the directory's scan for LRU
eviction, same-file checks on names that may have moved on, and ``flock`` polling."""

from __future__ import annotations

import fcntl
import os
import time

__all__ = ["SUFFIX", "TMP", "abandoned", "flock_within", "same_file", "scan", "unlink_if_same"]

SUFFIX, TMP = ".sdc", ".tmp"  # a published entry, a file being written


def scan(directory: str) -> tuple[list[tuple[int, str, int]], int]:
    """The published entries as ``(mtime_ns, path, size)``, oldest first, and the bytes the
    directory holds (entries and files being written; abandoned ones are deleted)."""
    entries, total = [], 0
    with os.scandir(directory) as it:
        for de in it:
            try:
                st = de.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted meanwhile
            if de.name.endswith(SUFFIX):
                entries.append((st.st_mtime_ns, de.path, st.st_size))
            elif not de.name.endswith(TMP) or abandoned(de.path):
                continue
            total += st.st_size
    entries.sort()
    return entries, total


def same_file(path: str, fd: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)


def unlink_if_same(path: str, fd: int) -> None:
    if same_file(path, fd):
        try:
            os.unlink(path)
        except OSError:
            pass


def abandoned(path: str) -> bool:
    """Delete ``path`` (a ``.tmp``) if no writer holds it (its writer died); True if deleted."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # being written
    try:
        unlink_if_same(path, fd)
    finally:
        os.close(fd)
    return True


def flock_within(fd: int, seconds: float) -> bool:
    """Take an exclusive ``flock`` on ``fd``, polling for at most ``seconds`` (never unbounded)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
