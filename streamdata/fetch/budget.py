"""How many bytes a reader's prefetcher may hold: the byte budget, grown to what the link needs.

Optimisation (BUDGET-GROWTH): a reader starts each pass with ``byte_budget`` (or what an
earlier pass of this process learned for the same endpoint) and never holds more than
``byte_budget_max``. Beyond one step at the start of a pass, by what its first first bytes
say of the endpoint (far or near: below), the budget grows only when the budget itself cost
the reader time: the reader waited for a part (a *stall*) whose request the budget had held
back, and what the reader consumes during that part's latency (from its request to its first
byte: its rate times that time, the bandwidth-delay product) is at least ``LATENCY_SHARE`` of
the budget, so that latency, not bandwidth, made it wait. It then grows by ``STEP`` (or to
the product, with a quarter more and one part, if that is more), capped.

The product alone would not do as the rule: a budget-bound reader's rate is set by its budget,
and the bytes it holds are not only in flight (fetched parts wait to be parsed, budget comes
back a MiB at a time), so the product reads below the budget while the reader stalls. The
latency is the first byte's, not the last's: a reader whose link is the limit waits for each
part about ``budget / bandwidth`` to its last byte, which would read as latency at any
distance. Only backends that stream the body to streamdata tell the first byte (S3's presigned
and LITE-S3 GETs: ``AsyncClient.get(first_byte=...)``); on the others the budget stays as set.
So:

- at a short round trip a part arrives in milliseconds and the product stays far below the
  budget: no growth, no extra memory (a fresh worker page-faults in every byte it holds);
- at a long one (another region) the budget grows within the first shards;
- a reader that is slower than the network never stalls, so its budget never grows;
- a far endpoint is known sooner: where the pass's first first bytes took ``FAR_S`` or more
  (the shorter of two: ``tune.FAR_PARTS``; a round trip of 100 ms or more: another region or
  continent, not one cold answer of a server), the budget takes one step at once (``far``),
  instead of after the first stall, which comes a round trip after the reader's first release.
  The step is ``STEP`` times the distance (``latency / FAR_S``): the bytes in flight that a
  link keeps busy grow with its round trip, so at 250 ms one-way the budget takes in one step
  what one ``STEP`` a round trip would take in four round trips.

The rate is what the reader released (consumed) over the last ``RATE_WINDOW_S`` seconds; no
decision is taken on less than ``MIN_HISTORY_S`` of it. Everything here runs on the
prefetcher's event loop (one thread): no lock.
"""

from __future__ import annotations

import collections
import time

__all__ = ["Budget", "distance"]

STEP = 2.0  # each growth multiplies the budget by at least this much
MARGIN = 1.25  # ... or makes it the bandwidth-delay product with this margin, if more
FAR_S = 0.1  # the pass's first part's first byte took this long or more: a far endpoint
LATENCY_SHARE = 0.25  # the product must be at least this share of the budget: latency-bound
RATE_WINDOW_S = 1.0
MIN_HISTORY_S = 0.1

_learned: dict[object, int] = {}  # endpoint -> the budget the last pass of this process grew to


def distance(latency: float) -> float:
    """How far an endpoint is whose first byte took ``latency`` s, in ``FAR_S``: 1 or more is a
    far endpoint, and the far steps (``Budget.far``, ``tune.Tuner.far``) scale with it."""
    return latency / FAR_S


class Budget:
    """One pass's byte budget: ``limit`` now, ``grown`` (times it grew), and the rate log."""

    def __init__(self, start: int, most: int, part_size: int, key: object = None) -> None:
        self.floor, self.most, self.part_size, self.key = start, max(start, most), part_size, key
        self.limit = min(self.most, max(start, _learned.get(key, 0)))
        self.grown = 0
        self._released: collections.deque[tuple[float, int]] = collections.deque()
        self._since: float | None = None  # when the reader first released bytes

    def released(self, nbytes: int, now: float | None = None) -> None:
        """The reader gave ``nbytes`` back (it consumed them)."""
        now = time.monotonic() if now is None else now
        if self._since is None:
            self._since = now
        self._released.append((now, nbytes))
        while self._released and now - self._released[0][0] > RATE_WINDOW_S:
            self._released.popleft()

    def rate(self, now: float | None = None) -> float | None:
        """Bytes per second the reader consumed lately; ``None`` before MIN_HISTORY_S of history."""
        now = time.monotonic() if now is None else now
        if self._since is None or now - self._since < MIN_HISTORY_S:
            return None
        span = min(RATE_WINDOW_S, now - self._since)
        return sum(n for t, n in self._released if now - t <= span) / span

    def far(self, latency: float) -> bool:
        """The pass's first part's first byte took ``latency`` seconds: one step at once if that
        says the endpoint is far (and nothing grew the budget yet), of ``STEP`` times the
        distance (``latency / FAR_S``). True if it grew."""
        if distance(latency) < 1 or self.grown or self.limit >= self.most or self.limit > self.floor:
            return False
        return self._grow(round(self.limit * STEP * distance(latency)))

    def _grow(self, limit: int) -> bool:
        self.limit = min(self.most, limit)
        self.grown += 1
        _learned[self.key] = self.limit
        return True

    def stalled(self, latency: float, now: float | None = None) -> bool:
        """The reader waited for a part the budget had held back, whose first byte took
        ``latency`` seconds from its request: grow if latency made it wait. True if it grew."""
        rate = self.rate(now)
        if rate is None or self.limit >= self.most:
            return False
        product = rate * latency
        if product < LATENCY_SHARE * self.limit:
            return False  # bandwidth, not latency, kept it: more in flight would not help
        return self._grow(max(int(product * MARGIN) + self.part_size, int(self.limit * STEP)))
