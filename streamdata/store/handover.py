"""Idle keep-alive connections handed from the constructor to the reader that sends next.

WARM-HANDOVER: the constructor's listing (LITE-S3, ``s3lite``) ends with a plain-http
keep-alive connection to the endpoint, idle, its last answer read to the end. Rather than
closing it, ``s3lite`` *offers* it here, and the next reader to connect to that endpoint
(``h1.Pool``, or ``s3lite`` itself) *claims* it and sends its first GET without a TCP handshake
(one round trip less before the first batch). Only ``store/`` offers and claims; ``fetch.parts``
asks how many wait (``waiting``) to size the first part. The rules:

- only ``http``: a TLS session lives in the ``ssl`` object of the process that made it and
  cannot be moved into another process's asyncio TLS layer; ``https`` connections are closed
  as before;
- an offer is good for ``MAX_IDLE_S`` seconds: servers close idle keep-alive connections
  after 5 s or more (nginx 75 s, Apache 5 s, S3 about 20 s); at 4 s a connection the server
  is about to drop is not used. A claimed socket must also not be readable: on an idle
  connection that means the server closed or reset it (or sent junk), so it is closed and the
  next offer tried; no request is ever sent on it;
- fork (a DataLoader worker): each child forked since the offers gets the first of them and
  nothing else (the DataLoader forks worker 0 first, and worker 0 produces the first batch).
  In the child the other offered descriptors are closed (``close``, never ``shutdown``: the
  connection is the parent's too until the parent drops it); in the parent the socket handed
  to that child is closed (its descriptor) and forgotten, so the parent never sends on it.
  The registry's lock is held across the fork (``_fork``'s before and after-in-parent hooks),
  so no other thread changes it in between; what a hook hands on is kept per forking thread
  (a second thread's hook that could not take the lock must not touch the first's);
- expired offers are closed when the registry is next touched (no timer thread).

``STREAMDATA_HANDOVER=0`` (``config.Switches.handover``, read once per process) closes every
offered socket instead.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time

from streamdata._fork import at_fork_before, at_fork_in_child, at_fork_in_parent
from streamdata.config import switches

__all__ = ["MAX_IDLE_S", "MAX_OFFERS", "claim", "offer", "stats", "waiting"]

MAX_IDLE_S = 4.0  # seconds an offered connection may stay idle (servers keep them 5 s or more)
MAX_OFFERS = 16  # idle connections kept at most (the oldest closed first)

Key = tuple[str, str, int]  # (scheme, host, port), as ``h1.Pool`` keys its connections

_lock = threading.Lock()
_Offer = tuple[Key, socket.socket, float]
_offers: list[_Offer] = []  # in offer order: the first goes to the next child
_stats = {"offered": 0, "claimed": 0, "dropped": 0, "handed": 0}
# per forking thread (two threads may fork at once): (lock held, the offers the child gets)
_forking: dict[int, tuple[bool, list[_Offer]]] = {}


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


def _ready(sock: socket.socket) -> bool:
    """Connected with nothing to read. An idle keep-alive connection with something to read
    was closed or reset by the server, or has junk on it: not ready."""
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
    if key[0] != "http" or not switches().handover:
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


def waiting(key: Key | None) -> int:
    """How many young offered connections to ``key`` wait here (in a forked worker: the one it
    was handed), for ``parts.first_part_size`` and CONNECT-AHEAD."""
    # locked on purpose: under 1 µs (16 offers), once per pass and per request that finds no idle
    # connection (``h1``); the prune keeps old offers out
    with _lock:
        _prune(time.monotonic())
        return sum(entry[0] == key for entry in _offers)


def claim(key: Key) -> socket.socket | None:
    """An offered connection to ``key`` that is ready (young, connected, not closed by the
    server), removed from the registry; ``None`` if there is none."""
    with _lock:
        _prune(time.monotonic())
        for entry in [entry for entry in _offers if entry[0] == key]:
            _offers.remove(entry)
            if _ready(entry[1]):
                entry[1].setblocking(True)  # no time-out of its last owner's: the claimant sets its own
                _stats["claimed"] += 1
                return entry[1]
            _close(entry[1])
            _stats["dropped"] += 1
        return None


# ---- fork: the next child gets the first offer ------------------------------------------------------


def _before_fork() -> None:
    held = _lock.acquire(timeout=1.0)  # a holder only closes or polls sockets: never long
    if held:
        _prune(time.monotonic())  # an aged offer is not handed
    _forking[threading.get_ident()] = (held, _offers[:1] if held else [])


def _in_parent() -> None:
    held, handed = _forking.pop(threading.get_ident(), (False, []))
    if not held:
        return  # the child closed every offer: the parent keeps them
    try:
        for entry in handed:
            if entry in _offers:
                _offers.remove(entry)
                _close(entry[1])  # the child's copy is now the connection's only one
                _stats["handed"] += 1
    finally:
        _lock.release()


def _in_child() -> None:
    global _lock
    _, handed = _forking.pop(threading.get_ident(), (False, []))
    _forking.clear()  # another parent thread's fork state means nothing here
    _lock = threading.Lock()  # the parent's lock may look held here
    for entry in list(_offers):  # ``handed`` is empty unless the lock was held across the fork
        if not any(entry is mine for mine in handed):
            _close(entry[1])
    _offers[:] = handed
    _stats.update(offered=len(_offers), claimed=0, dropped=0, handed=0)


at_fork_before(_before_fork)
at_fork_in_parent(_in_parent)
at_fork_in_child("sessions", _in_child)
