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
- spares (WARM-SPARES, ``spare``): while the listing's request is in flight, the constructor
  also starts opening ``STREAMDATA_SPARE_CONNECTIONS`` (default 8) more connections to the
  same address and offers them as they are (a TCP handshake costs a round trip, which the
  listing's own round trip hides). A claim takes only a connection whose handshake is done and
  that has nothing to read; one still opening is skipped and kept; one that failed is dropped.
  So a reader's first shard's parts and its window find open connections at once, where each
  would otherwise open its own (one round trip more before its bytes);
- fork (a DataLoader worker): each child forked since the offers gets the first of them and
  nothing else: one each, or, where ``share_among(n)`` says n children are coming (``sd.loader``
  does, as it starts its workers), an even share of what is left (``ceil(offers / children
  still to come)``, the DataLoader forks worker 0 first and worker 0 produces the first batch).
  In the child the other offered descriptors are closed (``close``, never ``shutdown``: the
  connection is the parent's too until the parent drops it); in the parent the sockets handed
  to that child are closed (its descriptors) and forgotten, so the parent never sends on them.
  The registry's lock is held across the fork (``_fork``'s before and after-in-parent hooks),
  so no other thread changes it in between; what a hook hands on is kept per forking thread
  (a second thread's hook that could not take the lock must not touch the first's);
- expired offers are closed when the registry is next touched (no timer thread).

``STREAMDATA_HANDOVER=0`` (``config.handover``) closes every offered socket instead (and
opens no spare); ``STREAMDATA_SPARE_CONNECTIONS=0`` opens no spare.
"""

from __future__ import annotations

import math
import selectors
import socket
import threading
import time

from streamdata._fork import at_fork_before, at_fork_in_child, at_fork_in_parent, install
from streamdata.config import handover, spare_connections

__all__ = ["MAX_IDLE_S", "MAX_OFFERS", "claim", "offer", "share_among", "spare", "stats", "waiting",
           "withdraw"]

MAX_IDLE_S = 4.0  # seconds an offered connection may stay idle (servers keep them 5 s or more)
MAX_OFFERS = 16  # idle connections kept at most (the oldest closed first): spares and the listing's

Key = tuple[str, str, int]  # (scheme, host, port), as ``h1.Pool`` keys its connections

_lock = threading.Lock()
_offers: list[tuple[Key, socket.socket, float]] = []  # in offer order: the first goes to the next child
_stats = {"offered": 0, "claimed": 0, "dropped": 0, "handed": 0, "spared": 0}
_Offer = tuple[Key, socket.socket, float]
# per forking thread (two threads may fork at once): (lock held, the offers the child gets)
_forking: dict[int, tuple[bool, list[_Offer]]] = {}
_children: tuple[int, float] = (0, 0.0)  # (children still to come, since when): ``share_among``


def stats() -> dict[str, int]:
    """This process's counts: ``offered`` (spares included); ``claimed`` (adopted by a reader
    here); ``dropped`` (closed unused: too old, closed by the server, or a spare that failed to
    open); ``handed`` (given to a forked child); ``spared`` (spares started, WARM-SPARES)."""
    with _lock:
        return dict(_stats)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()  # this process's descriptor only: never shutdown (WARM-HANDOVER)
    except OSError:
        pass


_READY, _OPENING, _DEAD = "ready", "opening", "dead"


def _state(sock: socket.socket) -> str:
    """``_READY``: connected, nothing to read. ``_DEAD``: readable (an idle keep-alive connection
    with something to read was closed or reset by the server, or has junk on it), or a spare
    whose connect failed. ``_OPENING``: a spare still in its handshake (not writable yet)."""
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
            events = sel.select(0)
            mask = events[0][1] if events else 0
            if mask & selectors.EVENT_READ or (mask and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)):
                return _DEAD
            return _READY if mask & selectors.EVENT_WRITE else _OPENING
    except (OSError, ValueError):  # closed, or not a socket any more
        return _DEAD


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
    install()  # a child forked from now on inherits the offer: FORK-RESET must run there
    with _lock:
        _prune(time.monotonic())
        _offers.append((key, sock, time.monotonic()))
        _stats["offered"] += 1
        while len(_offers) > MAX_OFFERS:
            _close(_offers.pop(0)[1])
            _stats["dropped"] += 1
    return True


def spare(key: Key, address: tuple, count: int | None = None) -> list[socket.socket]:
    """WARM-SPARES: start opening connections to ``key`` at ``address`` (a connected socket's
    ``getpeername()``), up to ``count`` (default ``STREAMDATA_SPARE_CONNECTIONS``) with those
    already offered to ``key``, and offer them as they are (no wait: a claim takes one once its
    handshake is done). Plain http only; returns those started (for ``withdraw``)."""
    if key[0] != "http" or not handover():
        return []
    count = spare_connections() if count is None else count
    if count <= 0:
        return []
    family = socket.AF_INET6 if len(address) == 4 else socket.AF_INET
    install()  # as in ``offer``
    with _lock:
        _prune(time.monotonic())
        room = min(count - sum(entry[0] == key for entry in _offers), MAX_OFFERS - len(_offers))
    started: list[socket.socket] = []
    for _ in range(max(0, room)):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # out of descriptors: the readers open their own
            break
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.connect_ex(address)  # EINPROGRESS; any error shows when it is claimed
        except OSError:
            _close(sock)
            break
        started.append(sock)
    with _lock:
        now = time.monotonic()
        _offers.extend((key, sock, now) for sock in started)
        _stats["spared"] += len(started)
        _stats["offered"] += len(started)
        while len(_offers) > MAX_OFFERS:  # an offer made meanwhile: the oldest go
            _close(_offers.pop(0)[1])
            _stats["dropped"] += 1
    return started


def withdraw(socks: list[socket.socket]) -> None:
    """Close those of ``socks`` still offered (spares for a listing that failed: nobody reads next)."""
    with _lock:
        for entry in [entry for entry in _offers if any(entry[1] is sock for sock in socks)]:
            _offers.remove(entry)
            _close(entry[1])
            _stats["dropped"] += 1


def waiting(key: Key | None) -> int:
    """How many young offered connections to ``key`` wait here (spares still opening included;
    in a forked worker: those it was handed), for ``parts.first_part_size`` and CONNECT-AHEAD."""
    # locked on purpose: under 1 µs (16 offers), once per pass and per request that finds no idle
    # connection (``store.http1``); the prune keeps old offers out
    with _lock:
        _prune(time.monotonic())
        return sum(entry[0] == key for entry in _offers)


def claim(key: Key) -> socket.socket | None:
    """An offered connection to ``key`` that is ready (young, connected, not closed by the
    server), removed from the registry; ``None`` if there is none. Spares still opening stay."""
    with _lock:
        _prune(time.monotonic())
        for entry in [entry for entry in _offers if entry[0] == key]:
            state = _state(entry[1])
            if state == _OPENING:
                continue
            _offers.remove(entry)
            if state == _READY:
                entry[1].setblocking(True)  # as an offered listing connection is
                _stats["claimed"] += 1
                return entry[1]
            _close(entry[1])
            _stats["dropped"] += 1
        return None


def share_among(children: int) -> None:
    """The next ``children`` forked children (a DataLoader's workers, about to start) share the
    offers evenly, instead of one each; forgotten after MAX_IDLE_S."""
    global _children
    with _lock:
        _children = (max(0, children), time.monotonic())


# ---- fork: the next child gets the first offers (its share) --------------------------------------------


def _share() -> int:
    """How many offers the child forked now gets (the lock held)."""
    coming, since = _children
    if coming <= 0 or time.monotonic() - since >= MAX_IDLE_S:
        return 1
    return math.ceil(len(_offers) / coming)


def _before_fork() -> None:
    held = _lock.acquire(timeout=1.0)  # a holder only closes or polls sockets: never long
    if held:
        _prune(time.monotonic())  # aged offers are neither handed nor counted in a share
    _forking[threading.get_ident()] = (held, _offers[:_share()] if held else [])


def _in_parent() -> None:
    global _children
    held, handed = _forking.pop(threading.get_ident(), (False, []))
    if not held:
        return  # the child closed every offer: the parent keeps them
    try:
        if _children[0] > 0:
            _children = (_children[0] - 1, _children[1])
        for entry in handed:
            if entry in _offers:
                _offers.remove(entry)
                _close(entry[1])  # the child's copy is now the connection's only one
                _stats["handed"] += 1
    finally:
        _lock.release()


def _in_child() -> None:
    global _lock, _children
    _, handed = _forking.pop(threading.get_ident(), (False, []))
    _forking.clear()  # another parent thread's fork state means nothing here
    _lock, _children = threading.Lock(), (0, 0.0)  # the parent's lock may look held here
    for entry in list(_offers):  # ``handed`` is empty unless the lock was held across the fork
        if not any(entry is mine for mine in handed):
            _close(entry[1])
    _offers[:] = handed
    _stats.update(offered=len(_offers), claimed=0, dropped=0, handed=0, spared=0)


at_fork_before(_before_fork)
at_fork_in_parent(_in_parent)
at_fork_in_child("sessions", _in_child)
