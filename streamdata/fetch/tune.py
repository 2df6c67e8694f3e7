"""A reader's I/O knobs, tuned to what it measures: window, concurrency, byte budget, part size.

AUTOTUNE (the rule): with ``FetchConfig.autotune`` (the default) one ``Tuner`` per prefetcher
holds the knobs its scheduler reads: ``window`` (items ahead), ``max_requests`` (parts in
flight), the byte budget (``budget.Budget``) and ``part_size``. Each moves only within its
bounds: from its start (``FetchConfig.tune_from``, else the configured value; the budget from
``byte_budget``) up to the configured value (``window``, ``max_requests``, ``part_size``: a
knob the user set is a bound tuning stays within) or, for the budget, the memory cap
``byte_budget_max``. A knob grows only when it cost the reader time, and stays grown only where
that raised the reader's throughput:

- the scheduler tags each part it had to hold back with the knob that held it and that knob's
  value then (``held``: the window, the request limit, the budget);
- when the reader waits for such a part (a *stall*), the window or the request limit grows
  by ``STEP`` if it still has the value that held the part (so one burst of stalls on parts
  held by one value grows it once);
- each such growth is judged after the fact (STEP-BACK, ``climb``): once the reader has
  consumed two byte budgets' worth since, its rate over the second is compared with its rate
  before the growth (growths in a burst judged as one; none before the reader's rate is
  known); one that did not raise it by ``climb.RISE`` steps back to the values before it, held
  there for ``climb.HOLD`` windows, doubled at each failure of the same knob (a loopback
  server that shares the client's cores can serve one request faster than 32: more is not
  always better, and only the reader's own throughput tells);
- the budget grows by BUDGET-GROWTH's rules (``budget``): where first-byte latency, not
  bandwidth, made the reader wait (the rate it consumes times that latency is a large share of
  the budget), or where the budget held the part back and its own last growth raised the
  reader's rate (the supply rule: where the budget itself holds the rate down, the product
  undercounts the latency);
- a far endpoint is known sooner: where the shorter of the pass's first ``FAR_PARTS`` first
  bytes took ``FAR_S`` (``budget``) or more (one slow answer may be a server's cold start), the
  budget takes its one step at once and the window and request limit one ``STEP`` each (where
  they start below their bounds: ``tune_from``), without a trial (no rate is known yet);
- the part size follows the budget: a quarter of it (``PARTS_IN_BUDGET`` parts in flight),
  at least ``MIN_PART`` and at most the configured ``part_size``, so a small budget still
  keeps several requests on the wire where latency is long. At the default 64 MiB budget
  that is the configured 8 MiB: the defaults fetch as fixed knobs do;
- a part held by READER-THROTTLE (``store.retry``: 503 / 429 lowered the limit below the
  tuned one) grows nothing: throttling wins, and the scheduler sends at most
  ``min(max_requests, throttle.allowed)``;
- knobs shrink only by a trial's step back, never below where they started, and the budget
  never shrinks: a reader that is slower than its link never stalls, so nothing grows, and
  memory stays within the cap either way. The next pass of the same process starts from what
  this one reached (per endpoint, as the budget does).

Only timing changes: items and parts are requested and consumed in the same order whatever
the knobs, so the data order is the same with or without tuning. Every decision is counted
(``metrics.COUNTERS``: ``budget.grown``, ``tuned.window``, ``tuned.max_requests``,
``tuned.part_size``, each a move either way, and ``tuned.back``, the trials stepped back) and
each reader's current knobs are in ``metrics.READER_STATS``
(``knob.*``), both in ``loader.metrics()``. ``autotune=False`` keeps every knob fixed (the
budget too). The controller is pure (no I/O; each event's time is its caller's ``now``, the
monotonic clock where none is given); the prefetcher calls it on its event loop (one thread):
no lock.
"""

from __future__ import annotations

import dataclasses
import time

from streamdata.config import FetchConfig
from streamdata.fetch.budget import FAR_S, Budget
from streamdata.fetch.climb import Climb, Mark
from streamdata.metrics import KNOBS

__all__ = ["FAR_PARTS", "MIN_PART", "PARTS_IN_BUDGET", "STEP", "Held", "Tuner"]

STEP = 4  # a window or request limit that held a part the reader waited for grows this much
FAR_PARTS = 2  # the far step reads the shortest of the pass's first this many first bytes
PARTS_IN_BUDGET = 4  # the part size is at most this share of the budget ...
MIN_PART = 1 << 20  # ... and at least this (or the configured part size, if smaller)

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
        # each knob's changes, and ``back``: trials whose growth did not raise the throughput (STEP-BACK)
        self.decisions = dict.fromkeys((*KNOBS, "back"), 0)
        self.part_size = self._part_for(self.budget.limit)
        self.climb = Climb(self.budget.most)  # STEP-BACK
        self._budget_mark: Mark | None = None  # the budget's last growth (BUDGET-GROWTH's supply rule)
        self._first: list[float] = []  # the pass's first first-byte latencies (the far step)

    def knobs(self) -> dict[str, int]:
        """The knobs now, by ``KNOBS`` name."""
        return {"window": self.window, "max_requests": self.max_requests,
                "byte_budget": self.budget.limit, "part_size": self.part_size}

    def _part_for(self, budget: int) -> int:
        if not self.on:
            return self.most_part
        return max(self.least_part, min(self.most_part, budget // PARTS_IN_BUDGET))

    def _budget_moved(self, was: int, now: float) -> None:
        self._budget_mark = self.climb.mark(was, now)
        self.decisions["byte_budget"] += 1
        part = self._part_for(self.budget.limit)
        if part != self.part_size:
            self.part_size = part
            self.decisions["part_size"] += 1

    def first_byte(self, latency: float, now: float | None = None) -> bool:
        """A part's first byte took ``latency`` s. The shortest of the pass's first
        ``FAR_PARTS`` decides the far step (``far``): a server's cold first answer alone is not
        a far endpoint. True if a knob moved."""
        if len(self._first) >= FAR_PARTS:
            return False
        self._first.append(latency)
        return len(self._first) == FAR_PARTS and self.far(min(self._first), now)

    def far(self, latency: float, now: float | None = None) -> bool:
        """The pass's first part's first byte took ``latency`` s: at a far endpoint
        (``budget.FAR_S`` or more) the budget takes its one step at once (``Budget.far``), and a
        window or request limit started below its bound a ``STEP``, before the first stall
        (a round trip after the reader's first release). True if a knob moved."""
        if not self.on:
            return False
        now = time.monotonic() if now is None else now
        moved, was = False, self.budget.limit
        if self.budget.far(latency):
            self._budget_moved(was, now)
            moved = True
        if latency >= FAR_S:  # before any rate is known: unjudged (STEP-BACK)
            moved = self._step("window", Held(window=self.window)) | moved
            moved = self._step("max_requests", Held(max_requests=self.max_requests)) | moved
        return moved

    def _step(self, knob: str, held: Held) -> bool:
        """Grow ``knob`` by ``STEP`` if ``held`` saw its value now, it is below its bound and
        no hold after a failed trial keeps it there (STEP-BACK)."""
        now = getattr(self, knob)
        most = self.most_window if knob == "window" else self.most_requests
        if getattr(held, knob) != now or now >= most:
            return False
        if not self.climb.allows(knob, now):
            return False
        setattr(self, knob, min(most, now * STEP))
        self.decisions[knob] += 1
        _learned[self.key] = (self.window, self.max_requests)
        return True

    def stalled(self, held: Held, latency: float | None, now: float | None = None) -> bool:
        """The reader waited for a part that ``held`` had held back, whose first byte took
        ``latency`` s (None: the backend does not tell). True if a knob moved."""
        if not self.on:
            return False
        now = time.monotonic() if now is None else now
        before = {knob: getattr(self, knob) for knob in ("window", "max_requests")}
        grown = {knob: value for knob, value in before.items() if self._step(knob, held)}
        if grown:  # a trial (STEP-BACK): kept if the reader's throughput rose
            self.climb.grew(grown, self.budget.limit, now)
        moved = bool(grown)
        if held.budget is not None and latency is not None:
            was = self.budget.limit
            rose = self._budget_mark.rose(self.climb.meter, now) if self._budget_mark is not None else None
            if self.budget.stalled(latency, now, rose):
                self._budget_moved(was, now)
                moved = True
        return moved

    def released(self, nbytes: int, now: float | None = None) -> bool:
        """The reader consumed ``nbytes`` (BUDGET-GROWTH's rate, STEP-BACK's windows); True if
        a trial's verdict stepped the window or the request limit back."""
        now = time.monotonic() if now is None else now
        self.budget.released(nbytes, now)
        if not self.on:
            return False
        back = self.climb.released(nbytes, now)
        if not back:
            return False
        for knob, value in back.items():
            if getattr(self, knob) != value:
                setattr(self, knob, value)
                self.decisions[knob] += 1
        self.decisions["back"] += 1
        _learned[self.key] = (self.window, self.max_requests)
        return True

    def requests_allowed(self, throttled: int) -> int:
        """Parts that may be in flight: the tuned limit, or fewer under READER-THROTTLE."""
        return min(self.max_requests, throttled)
