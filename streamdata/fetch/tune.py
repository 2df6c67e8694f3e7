"""A reader's I/O knobs, tuned to what it measures: window, concurrency, byte budget, part size.

AUTOTUNE (the rule): with ``FetchConfig.autotune`` (the default) one ``Tuner`` per prefetcher
holds the knobs its scheduler reads: ``window`` (items ahead), ``max_requests`` (parts in
flight), the byte budget (``budget.Budget``) and ``part_size``. Each moves only within its
bounds: from its start (``FetchConfig.tune_from``, else the configured value; the budget from
``byte_budget``) up to the configured value (``window``, ``max_requests``, ``part_size``: a
knob the user set is a bound tuning stays within) or, for the budget, the memory cap
``byte_budget_max``. A knob grows only when it cost the reader time:

- the scheduler tags each part it had to hold back with the knob that held it and that knob's
  value then (``held``: the window, the request limit, the budget);
- when the reader waits for such a part (a *stall*), the window or the request limit grows
  by ``STEP`` if it still has the value that held the part (so one burst of stalls on parts
  held by one value grows it once);
- WINDOW-IDLE: a window that holds the next item back while nothing is in flight and the
  budget has room for that item's first part grows then, as on a stall: the link idles, and
  the reader will wait for that part at the item's start whatever its pace (nothing fetches it
  before the reader gets there). A window of one item so grows while the reader reads its
  first item, not after its wait at the next item's start (from the smallest start at 0 ms,
  a wait of 40-65 ms per worker);
- the budget grows by BUDGET-GROWTH's rule (``budget``): only where first-byte latency, not
  bandwidth, made the reader wait (the rate it consumes times that latency is a large share of
  the budget);
- a far endpoint is known sooner: where the shorter of the pass's first ``FAR_PARTS`` first
  bytes took ``FAR_S`` (``budget``) or more (one slow answer may be a server's cold start), the
  budget takes its one step at once and the window and request limit one each (where they
  start below their bounds: ``tune_from``), before any rate is known, each step scaled by the
  distance (``STEP`` times ``latency / FAR_S``: the parts a link needs in flight grow with its
  round trip);
- QUEUE-FIT: requests in flight beyond what hides the round trip only queue at the server.
  Each part's first byte is noted with the number of parts in flight when it was sent; over
  the last ``FIT_PARTS`` (sent at in-flight counts at least ``FIT_SPREAD`` apart: the pass's
  first burst ramps from one to the limit) a straight line ``latency = a + s * n`` is fitted.
  Where the slope is real (over the spread it adds ``FLAT`` of ``a`` or more: the server
  serves requests one after another, as a loaded one does), the request limit is held at
  ``1 + a / s``: one request, plus as many as fit in the part of the latency that is not the
  server's own work on them (a near, busy server: 1-2; 25 ms one-way: 3-6). Where latency
  does not grow with the requests in flight (S3, where parallel connections are how bandwidth
  is had), nothing is held. The fit lowers the limit to that, and stalls grow it no further
  while it stands. Only near endpoints are fitted (the far step did not fire): at a far one
  the requests in flight are what cover the round trip, and a reader's own count in flight
  is a poor measure of a server that other readers load too (at 100 ms one-way the fit held
  1-5 requests where 8-32 ran fastest);
- NEAR-START: where the pass's first first byte (the reader's first probe, sent alone, before
  the window's requests go out) comes under ``FAR_S``, a request limit that starts at its
  bound starts at ``NEAR_START`` instead: a near endpoint's first burst is then not a budget's
  worth of parts at once, which a busy server only queues; stalls grow it (to the QUEUE-FIT
  ceiling), as from any start. A budget too small to cut full-size parts (under
  ``PARTS_IN_BUDGET`` times ``part_size``) takes one step to that size at once
  (``Budget.near``, within the cap): a near server charges each request its own work, not a
  round trip, so the small parts of a small budget cost the reader requests, not bytes in
  flight (from 8 MiB at 0 ms, the pass reached 90% of the best fixed setting's rate within
  the first tenth of the epoch in 14 of 20 rounds, against 9 of 20 without the step:
  benchmarks/README.md, "Autotune");
- the part size follows the budget: a quarter of it (``PARTS_IN_BUDGET`` parts in flight),
  at least ``MIN_PART`` and at most the configured ``part_size``, so a small budget still
  keeps several requests on the wire where latency is long. At the default 64 MiB budget
  that is the configured 8 MiB: the defaults fetch as fixed knobs do. Where QUEUE-FIT holds
  the request limit under ``PARTS_IN_BUDGET - 1``, the parts are a ``ceiling + 1``-th of the
  budget instead (one or two in flight and one being read): a server that queues charges
  each request its service time, so where few may be on the wire each carries more;
- a part held by READER-THROTTLE (``store.retry``: 503 / 429 lowered the limit below the
  tuned one) grows nothing: throttling wins, and the scheduler sends at most
  ``min(max_requests, throttle.allowed)``;
- knobs never shrink within a pass: a reader that is slower than its link never stalls, so
  nothing grows but a window below its bound (WINDOW-IDLE), and memory stays within the cap
  either way. The next pass of the same process starts from what this one reached (per
  endpoint, as the budget does).

Only timing changes: items and parts are requested and consumed in the same order whatever
the knobs, so the data order is the same with or without tuning. Every decision is counted
(``metrics.COUNTERS``: ``budget.grown``, ``tuned.window``, ``tuned.max_requests``,
``tuned.part_size``) and each reader's current knobs are in ``metrics.READER_STATS``
(``knob.*``), both in ``loader.metrics()``. ``autotune=False`` keeps every knob fixed (the
budget too). The controller is pure (no clock of its own, no I/O); the prefetcher calls it on
its event loop (one thread): no lock.
"""

from __future__ import annotations

import collections
import dataclasses

from streamdata.config import FetchConfig
from streamdata.fetch.budget import Budget, distance
from streamdata.metrics import KNOBS

__all__ = ["FAR_PARTS", "FIT_PARTS", "MIN_PART", "PARTS_IN_BUDGET", "STEP", "Held", "Tuner"]

STEP = 4  # a window or request limit that held a part the reader waited for grows this much
FAR_PARTS = 2  # the far step reads the shortest of the pass's first this many first bytes
PARTS_IN_BUDGET = 4  # the part size is at most this share of the budget ...
MIN_PART = 1 << 20  # ... and at least this (or the configured part size, if smaller)
FIT_PARTS = 8  # QUEUE-FIT: the last this many parts' first bytes, against their requests in flight
FIT_SPREAD = 3  # ... fitted once they were sent at in-flight counts at least this far apart
FLAT = 0.25  # a slope that adds less than this share of the intercept over the spread: no queue
NEAR_START = 4  # a near endpoint's request limit starts here, not at its bound (QUEUE-FIT, stalls: from it)

_learned: dict[object, tuple[int, int]] = {}  # endpoint -> (window, max_requests) reached


@dataclasses.dataclass
class Held:
    """What held a part back when the scheduler sent it: each knob's value then (None: not it)."""

    window: int | None = None
    max_requests: int | None = None
    budget: int | None = None


class Tuner:
    """One prefetcher's knobs (AUTOTUNE). ``decisions`` counts each knob's changes."""

    def __init__(self, config: FetchConfig, key: object = None) -> None:
        self.on = config.autotune
        start = dict(config.tune_from or ()) if self.on else {}
        self.most_window, self.most_requests = config.window, config.max_requests
        self.most_part = config.part_size
        self.least_part = min(MIN_PART, config.part_size)
        self.key = key
        learned = _learned.get(key, (0, 0)) if self.on else (0, 0)
        self.window = min(self.most_window, max(start.get("window", config.window), learned[0]))
        self.max_requests = min(self.most_requests, max(start.get("max_requests", config.max_requests),
                                                        learned[1]))
        cap = config.budget_max() if self.on else config.byte_budget
        self.budget = Budget(config.byte_budget, cap, config.part_size, key=key)  # BUDGET-GROWTH
        self.decisions = dict.fromkeys(KNOBS, 0)
        self.ceiling = self.most_requests  # QUEUE-FIT: the request limit stalls may grow to now
        self.part_size = self._part_for(self.budget.limit)
        self._first: list[float] = []  # the pass's first first-byte latencies (the far step)
        self._far = False  # what the shorter of them said (QUEUE-FIT fits only a near endpoint)
        self._sent: collections.deque[tuple[int, float]] = collections.deque(maxlen=FIT_PARTS)

    def knobs(self) -> dict[str, int]:
        """The knobs now, by ``KNOBS`` name."""
        return {"window": self.window, "max_requests": self.max_requests,
                "byte_budget": self.budget.limit, "part_size": self.part_size}

    def _part_for(self, budget: int) -> int:
        if not self.on:
            return self.most_part
        parts = min(PARTS_IN_BUDGET, self.ceiling + 1)  # QUEUE-FIT: few on the wire, each larger
        return max(self.least_part, min(self.most_part, budget // parts))

    def _budget_moved(self) -> None:
        self.decisions["byte_budget"] += 1
        self._cut()

    def _cut(self) -> bool:
        """The part size for the budget and the ceiling now (counted if it moved). True if so."""
        part = self._part_for(self.budget.limit)
        if part == self.part_size:
            return False
        self.part_size = part
        self.decisions["part_size"] += 1
        return True

    @property
    def wants_first_byte(self) -> bool:
        """Whether the far step still waits for first bytes (``first_byte``): only the pass's
        first ``FAR_PARTS``, with tuning on; after them a part's first byte feeds QUEUE-FIT
        alone (a fit over ``FIT_PARTS`` pairs)."""
        return self.on and len(self._first) < FAR_PARTS

    def first_byte(self, latency: float, inflight: int = 1) -> bool:
        """A part's first byte took ``latency`` s; ``inflight`` parts were in flight when it was
        sent, itself included. The shortest of the pass's first ``FAR_PARTS`` decides the far
        step (``far``): a server's cold first answer alone is not a far endpoint. Every part's
        goes to QUEUE-FIT (``_fit``). True if a knob moved."""
        if not self.on:
            return False
        moved = False
        if not self._first and distance(latency) < 1:
            # NEAR-START: the pass's first first byte says near (before the window's burst goes
            # out): the request limit starts low (stalls grow it, QUEUE-FIT bounds it), and a
            # small budget takes full parts
            if self.max_requests > NEAR_START:
                self.max_requests = NEAR_START
                self.decisions["max_requests"] += 1
                moved = True
            if self.budget.near(PARTS_IN_BUDGET * self.most_part):
                self._budget_moved()
                moved = True
        if self.wants_first_byte:
            self._first.append(latency)
            if len(self._first) == FAR_PARTS:
                self._far = distance(min(self._first)) >= 1
                moved = self.far(min(self._first)) | moved
        self._sent.append((inflight, latency))
        return self._fit() | moved

    def _fit(self) -> bool:
        """QUEUE-FIT: the request limit's ceiling from the last first bytes against their
        in-flight counts, and the limit lowered to it. True if the limit moved."""
        if len(self._sent) < FIT_PARTS or self._far:
            return False  # too few yet; or a far endpoint, where requests in flight cover the round trip
        counts = [n for n, _ in self._sent]
        spread = max(counts) - min(counts)
        if spread < FIT_SPREAD:
            return False  # sent alike: nothing to fit a slope to (the ceiling stands)
        mean_n = sum(counts) / len(counts)
        mean_l = sum(latency for _, latency in self._sent) / len(counts)
        slope = (sum((n - mean_n) * (latency - mean_l) for n, latency in self._sent)
                 / sum((n - mean_n) ** 2 for n in counts))
        intercept = max(0.0, mean_l - slope * mean_n)
        if slope * spread < FLAT * intercept or slope <= 0:
            self.ceiling = self.most_requests  # latency does not grow with requests: no queue
        else:
            self.ceiling = max(1, min(self.most_requests, round(1 + intercept / slope)))
        moved = self._cut()  # the parts follow the ceiling
        if self.max_requests <= self.ceiling:
            return moved
        self.max_requests = self.ceiling
        self.decisions["max_requests"] += 1
        return True

    def far(self, latency: float) -> bool:
        """The pass's first first bytes took ``latency`` s (``first_byte``): at a far endpoint
        (``budget.FAR_S`` or more) the budget takes its one step at once (``Budget.far``), and a
        window or request limit started below its bound one of ``STEP`` times the distance
        (``latency / FAR_S``), before the first stall (a round trip after the reader's first
        release). True if a knob moved."""
        if not self.on:
            return False
        moved = False
        if self.budget.far(latency):
            self._budget_moved()
            moved = True
        if distance(latency) >= 1:
            factor = STEP * distance(latency)
            moved = self._step("window", Held(window=self.window), factor) | moved
            moved = self._step("max_requests", Held(max_requests=self.max_requests), factor) | moved
        return moved

    def _step(self, knob: str, held: Held, factor: float = STEP) -> bool:
        """Grow ``knob`` by ``factor`` if ``held`` saw its value now and it is below its bound."""
        now = getattr(self, knob)
        most = self.most_window if knob == "window" else self.ceiling
        if getattr(held, knob) != now or now >= most:
            return False
        setattr(self, knob, min(most, round(now * factor)))
        self.decisions[knob] += 1
        _learned[self.key] = (self.window, self.max_requests)
        return True

    def idle_window(self, window: int) -> bool:
        """WINDOW-IDLE: the window (at ``window``) alone held the next item back while nothing
        was in flight and the budget had room for its first part. The reader will wait for
        that part when it gets there (it is not on its way), so the window grows now, as on
        that stall (once per value, within its bound). True if it moved."""
        return self.on and self._step("window", Held(window=window))

    def stalled(self, held: Held, latency: float | None, now: float | None = None) -> bool:
        """The reader waited for a part that ``held`` had held back, whose first byte took
        ``latency`` s (None: the backend does not tell). True if a knob moved."""
        if not self.on:
            return False
        moved = self._step("window", held)
        moved = self._step("max_requests", held) | moved
        if held.budget is not None and latency is not None and self.budget.stalled(latency, now):
            self._budget_moved()
            moved = True
        return moved

    def requests_allowed(self, throttled: int) -> int:
        """Parts that may be in flight: the tuned limit, or fewer under READER-THROTTLE."""
        return min(self.max_requests, throttled)
