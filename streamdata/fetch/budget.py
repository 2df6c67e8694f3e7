"""How many bytes a reader's prefetcher may hold: the byte budget, grown to what the link needs.

BUDGET-GROWTH (the invariant): a reader starts each pass with ``byte_budget`` (or what an
earlier pass of this process learned for the same endpoint) and never holds more than
``byte_budget_max``. The budget grows only when the budget itself cost the reader time: the
reader waited for a part (a *stall*) whose request the budget had held back, and what the
reader consumes during that part's latency (from its request to its first byte: its rate times
that time, the bandwidth-delay product) is at least ``LATENCY_SHARE`` of the budget, so that
latency, not bandwidth, made it wait. It then grows by ``STEP`` (or to the product, with a
quarter more and one part, if that is more), capped. Or (the supply rule) the reader still
waits for parts the budget held back and the budget's last growth raised its throughput
(``Mark``: the reader's rate over a window of consumed bytes after it, against its rate before,
by ``RISE`` or more): then it grows by ``SUPPLY_STEP``, capped, and that growth is judged the
same way.

The supply rule is there because the product undercounts where the budget itself limits the
rate: a reader held to a few parts in flight consumes little per round trip, so its rate times
the latency can stay a small share of the budget however far the endpoint is (from an 8 MiB
start at 250 ms one-way, on epochs of 64 MiB per reader, the budget ended at 32-64 MiB of a
128 MiB cap while the reader kept waiting). Measured, it changed nothing beyond noise: on those
short epochs the epoch ends first either way, and with 256 MiB per reader the product rule also
reached the cap (benchmarks/README.md, "Autotune"). Rates are over windows of consumed bytes,
not over wall time: a window spans a budget's worth (a burst and the wait after it), not the
noise of one part. A growth that did not raise the rate ends the supply rule's run (the
product rule still applies); a growth with no rate before it (the far step, or too few bytes
consumed before it) counts as risen once. A growth's window is the budget before it (one round
of what the budget kept in flight); its rate before is over as much of one window as was
consumed, if at least ``BASELINE`` of it; its verdict comes once the reader has consumed two
windows since (the first were requested under the old budget), from the rate over the second.

The product alone would not do as the rule: a budget-bound reader's rate is set by its budget,
and the bytes it holds are not only in flight (fetched parts wait to be parsed, budget comes
back a MiB at a time), so at 64 MiB and 100 ms one-way the product read 28-48 MB while the
reader stalled. The latency is the first byte's, not the last's: a reader whose link is the
limit waits for each part about ``budget / bandwidth`` to its last byte, which would read as
latency at any distance (found in review: 54 ms at 1.25 GB/s and 0 ms one-way). Only backends
that stream the body to streamdata tell the first byte (S3's presigned and LITE-S3 GETs:
``AsyncClient.get(first_byte=...)``); on the others the budget stays as set. So:

- at a short round trip a part arrives in milliseconds and the product stays far below the
  budget: no growth, no extra memory (a fresh worker page-faults in every byte it holds);
- at a long one (another region: benchmarks/README.md, "Latency", where a fixed budget held
  the pass below the grown one's rate) the budget grows within the first shards;
- a reader that is slower than the network never stalls, so its budget never grows;
- a far endpoint is known sooner: where the pass's first first bytes took ``FAR_S`` or more
  (the shorter of two: ``tune.FAR_PARTS``; a round trip of 100 ms or more: another region or
  continent, not one cold answer of a server), the budget takes one
  ``STEP`` at once (``far``), instead of after the first stall, which comes a round trip after
  the reader's first release (0.5-0.8 s into the first pass at 100 ms one-way).

The product's rate is what the reader released (consumed) over the last ``RATE_WINDOW_S``
seconds; no decision is taken on less than ``MIN_HISTORY_S`` of it. The supply rule's rates
(``Meter``) are kept only while the budget can still grow. Everything here runs on the
prefetcher's event loop (one thread): no lock.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import time

__all__ = ["Budget", "Mark", "Meter"]

STEP = 2.0  # each growth multiplies the budget by at least this much
SUPPLY_STEP = 4  # ... and each growth by the supply rule by this much
MARGIN = 1.25  # ... or makes it the bandwidth-delay product with this margin, if more
FAR_S = 0.1  # the pass's first part's first byte took this long or more: a far endpoint
LATENCY_SHARE = 0.25  # the product must be at least this share of the budget: latency-bound
RISE = 0.05  # a growth raised the rate if the rate after is this much above the rate before
BASELINE = 0.5  # a growth is judged against a rate over at least this share of its window
RATE_WINDOW_S = 1.0
MIN_HISTORY_S = 0.1

_learned: dict[object, int] = {}  # endpoint -> the budget the last pass of this process grew to


class Meter:
    """What the reader consumed: the running total, and when it passed each amount (from its
    first release on: the bytes before it came in no time anyone measured)."""

    def __init__(self) -> None:
        self.total = 0
        self._totals: list[int] = []
        self._times: list[float] = []

    def released(self, nbytes: int, now: float) -> None:
        """The reader consumed ``nbytes`` more at ``now``."""
        self.total += nbytes
        self._totals.append(self.total)
        self._times.append(now)

    def measured(self) -> int:
        """Bytes consumed since the first release: the longest window a rate can span."""
        return self.total - self._totals[0] if self._totals else 0

    def rate(self, window: int, now: float) -> float | None:
        """Bytes per second over the last ``window`` bytes consumed (to ``now``); None before
        ``window`` bytes since the first release."""
        if self.measured() < window:
            return None
        # the latest point at or below total - window: the window starts there
        i = bisect.bisect_right(self._totals, self.total - window) - 1
        start = self._times[i]
        if now <= start:
            return None
        return (self.total - self._totals[i]) / (now - start)

    def trim(self, keep: int) -> None:
        """Forget points more than ``keep`` bytes back (the longest window still asked for)."""
        i = bisect.bisect_right(self._totals, self.total - keep) - 1
        if i > 64:  # in batches: a point is a MiB released, trimming each would cost more
            del self._totals[:i], self._times[:i]


@dataclasses.dataclass
class Mark:
    """A growth to judge: the total consumed then, the window its rates span, the rate before."""

    at: int
    window: int
    before: float | None

    @classmethod
    def at_growth(cls, meter: Meter, window: int, now: float) -> Mark:
        """A growth now, its rates over ``window`` bytes: the rate before over as much of one
        window as was measured, if at least ``BASELINE`` of it, else none."""
        measured = min(window, meter.measured())
        return cls(meter.total, window, meter.rate(measured, now) if measured >= BASELINE * window else None)

    def rose(self, meter: Meter, now: float) -> bool | None:
        """Whether the rate after the growth rose ``RISE`` over the rate before; None: not yet
        known (too little consumed since). A growth with no rate before counts as risen."""
        if meter.total < self.at + 2 * self.window:
            return None
        if self.before is None:
            return True
        after = meter.rate(self.window, now)
        return after is not None and after >= self.before * (1 + RISE)


class Budget:
    """One pass's byte budget: ``limit`` now, ``grown`` (times it grew), and the rate log."""

    def __init__(self, start: int, most: int, part_size: int, key: object = None) -> None:
        self.floor, self.most, self.part_size, self.key = start, max(start, most), part_size, key
        self.limit = min(self.most, max(start, _learned.get(key, 0)))
        self.grown = 0
        self._released: collections.deque[tuple[float, int]] = collections.deque()
        self._since: float | None = None  # when the reader first released bytes
        self.meter = Meter()  # consumed bytes, for the supply rule's rates
        self._mark: Mark | None = None  # the last growth, judged by the supply rule

    def released(self, nbytes: int, now: float | None = None) -> None:
        """The reader gave ``nbytes`` back (it consumed them)."""
        now = time.monotonic() if now is None else now
        if self._since is None:
            self._since = now
        self._released.append((now, nbytes))
        while self._released and now - self._released[0][0] > RATE_WINDOW_S:
            self._released.popleft()
        if self.limit < self.most:  # it may still grow: the supply rule's rates
            self.meter.released(nbytes, now)
            self.meter.trim(2 * self.most)

    def rate(self, now: float | None = None) -> float | None:
        """Bytes per second the reader consumed lately; ``None`` before MIN_HISTORY_S of history."""
        now = time.monotonic() if now is None else now
        if self._since is None or now - self._since < MIN_HISTORY_S:
            return None
        span = min(RATE_WINDOW_S, now - self._since)
        return sum(n for t, n in self._released if now - t <= span) / span

    def far(self, latency: float, now: float | None = None) -> bool:
        """The pass's first part's first byte took ``latency`` seconds: one step at once if that
        says the endpoint is far (and nothing grew the budget yet). True if it grew."""
        if latency < FAR_S or self.grown or self.limit >= self.most or self.limit > self.floor:
            return False
        return self._grow(int(self.limit * STEP), time.monotonic() if now is None else now)

    def _grow(self, limit: int, now: float) -> bool:
        self._mark = Mark.at_growth(self.meter, self.limit, now)  # judged by the supply rule
        self.limit = min(self.most, limit)
        self.grown += 1
        _learned[self.key] = self.limit
        return True

    def stalled(self, latency: float, now: float | None = None) -> bool:
        """The reader waited for a part the budget had held back, whose first byte took
        ``latency`` seconds from its request: grow if latency made it wait, or (the supply
        rule) if the last growth raised the reader's throughput. True if it grew."""
        now = time.monotonic() if now is None else now
        rate = self.rate(now)
        if rate is None or self.limit >= self.most:
            return False
        product = rate * latency
        if product >= LATENCY_SHARE * self.limit:
            return self._grow(max(int(product * MARGIN) + self.part_size, int(self.limit * STEP)), now)
        if self._mark is not None and self._mark.rose(self.meter, now):
            # the product undercounts: the budget itself holds the rate down
            return self._grow(self.limit * SUPPLY_STEP, now)
        return False  # bandwidth, not latency, kept it: more in flight would not help
