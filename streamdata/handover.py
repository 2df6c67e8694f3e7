"""Idle keep-alive connections handed from the constructor to the reader that sends next.

WARM-HANDOVER: the constructor's listing (LITE-S3, ``s3lite``) ends with a plain-http
keep-alive connection to the endpoint, idle, its last answer read to the end. Rather than
closing it, ``s3lite`` *offers* it here, and the next reader to connect to that endpoint
*claims* it and sends its first GET without a TCP handshake (one round trip less before the
first batch). The rules:

- only ``http``: a TLS session lives in the ``ssl`` object of the process that made it and
  cannot be moved into another process's asyncio TLS layer; ``https`` connections are closed
  as before;
- an offer is good for ``MAX_IDLE_S`` seconds: servers close idle keep-alive connections
  after 5 s or more (nginx 75 s, Apache 5 s, S3 about 20 s); at 4 s a connection the server
  is about to drop is not used. A claimed socket must also not be readable: on an idle
  connection that means the server closed or reset it (or sent junk), so it is closed and the
  next offer tried; no request is ever sent on it;
- fork (a DataLoader worker): the n-th child forked since the offers gets the n-th offered
  socket (the DataLoader forks worker 0 first, and worker 0 produces the first batch), and
  nothing else: in the child the other offered descriptors are closed (``close``, never
  ``shutdown``: the connection is the parent's too until the parent drops it); in the parent
  the socket handed to that child is closed (its descriptor) and forgotten, so the parent
  never sends on it. The registry's lock is held across the fork (``_fork``'s before and
  after-in-parent hooks), so no other thread changes it in between;
- expired offers are closed when the registry is next touched (no timer thread).

``STREAMDATA_HANDOVER=0`` (``config.handover``) closes every offered socket instead.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

from ._fork import at_fork_before, at_fork_in_child, at_fork_in_parent
from .config import handover

__all__ = ["MAX_IDLE_S", "MAX_OFFERS", "claim", "offer", "stats", "waiting"]

MAX_IDLE_S = 4.0  # seconds an offered connection may stay idle (servers keep them 5 s or more)
MAX_OFFERS = 8  # idle connections kept at most (the oldest closed first)

Key = tuple[str, str, int]  # (scheme, host, port), as ``h1.Pool`` keys its connections

_lock = threading.Lock()
_offers: list[tuple[Key, socket.socket, float]] = []  # in offer order: the first goes to the next child
_stats = {"offered": 0, "claimed": 0, "dropped": 0, "handed": 0}
_forking: tuple[bool, tuple[Key, socket.socket, float] | None] = (False, None)  # (lock held, handed)


def stats() -> dict[str, int]:
    """This process's counts: ``offered``; ``claimed`` (adopted by a reader here); ``dropped``
    (closed unused: too old, or closed by the server); ``handed`` (given to a forked child)."""
    with _lock:
        return dict(_stats)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()  # this process's descriptor only: never shutdown (WARM-HANDOVER)
    except OSError:
        pass


def _alive(sock: socket.socket) -> bool:
    """Not readable: an idle keep-alive connection with something to read was closed or reset
    by the server (or has junk on it)."""
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ)
            return not sel.select(0)
    except (OSError, ValueError):  # closed, or not a socket any more
        return False


def _prune(now: float) -> None:
    """Close offers past their age (the lock held)."""
    keep = []
    for entry in _offers:
        if now - entry[2] < MAX_IDLE_S:
            keep.append(entry)
        else:
            _close(entry[1])
            _stats["dropped"] += 1
    _offers[:] = keep


def offer(key: Key, sock: socket.socket) -> bool:
    """Keep ``sock`` (an idle keep-alive connection to ``key``, its last answer read whole) for
    the next reader; False where it was closed instead (https, or ``STREAMDATA_HANDOVER=0``)."""
    if key[0] != "http" or not handover():
        _close(sock)
        return False
    with _lock:
        _prune(time.monotonic())
        _offers.append((key, sock, time.monotonic()))
        _stats["offered"] += 1
        while len(_offers) > MAX_OFFERS:
            _close(_offers.pop(0)[1])
            _stats["dropped"] += 1
    return True


def waiting(key: Key | None) -> bool:
    """Whether a young offered connection to ``key`` waits here (in a forked worker: the one
    it was handed), for ``parts.first_part_size``."""
    # locked on purpose: under 1 µs (8 offers), once per pass and per request that finds no idle
    # connection (``h1``); the prune keeps old offers out
    with _lock:
        _prune(time.monotonic())
        return any(entry[0] == key for entry in _offers)


def claim(key: Key) -> socket.socket | None:
    """An offered connection to ``key`` that is still good (young, not closed by the server),
    removed from the registry; ``None`` if there is none."""
    with _lock:
        _prune(time.monotonic())
        while True:
            found = next((entry for entry in _offers if entry[0] == key), None)
            if found is None:
                return None
            _offers.remove(found)
            if _alive(found[1]):
                _stats["claimed"] += 1
                return found[1]
            _close(found[1])
            _stats["dropped"] += 1


# ---- fork: the next child gets the first offer --------------------------------------------


def _before_fork() -> None:
    global _forking
    held = _lock.acquire(timeout=1.0)  # a holder only closes or polls sockets: never long
    _forking = (held, _offers[0] if held and _offers else None)


def _in_parent() -> None:
    global _forking
    held, handed = _forking
    _forking = (False, None)
    if not held:
        return  # the child closed every offer: the parent keeps them
    try:
        if handed is not None and handed in _offers:
            _offers.remove(handed)
            _close(handed[1])  # the child's copy is now the connection's only one
            _stats["handed"] += 1
    finally:
        _lock.release()


def _in_child() -> None:
    global _lock, _forking
    held, handed = _forking
    _lock, _forking = threading.Lock(), (False, None)  # the parent's lock may look held here
    for entry in list(_offers):
        if not (held and entry is handed):
            _close(entry[1])
    _offers[:] = [handed] if held and handed is not None else []
    _stats.update(offered=len(_offers), claimed=0, dropped=0, handed=0)


at_fork_before(_before_fork)
at_fork_in_parent(_in_parent)
at_fork_in_child("sessions", _in_child)
