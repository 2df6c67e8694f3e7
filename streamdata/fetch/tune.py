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
- the budget grows by BUDGET-GROWTH's rule (``budget``): only where first-byte latency, not
  bandwidth, made the reader wait (the rate it consumes times that latency is a large share of
  the budget);
- a far endpoint is known sooner: where the shorter of the pass's first ``FAR_PARTS`` first
  bytes took ``FAR_S`` (``budget``) or more (one slow answer may be a server's cold start), the
  budget takes its one step at once and the window and request limit one each (where they
  start below their bounds: ``tune_from``), before any rate is known, each step scaled by the
  distance (``STEP`` times ``latency / FAR_S``: the parts a link needs in flight grow with its
  round trip);
- the part size follows the budget: a quarter of it (``PARTS_IN_BUDGET`` parts in flight),
  at least ``MIN_PART`` and at most the configured ``part_size``, so a small budget still
  keeps several requests on the wire where latency is long. At the default 64 MiB budget
  that is the configured 8 MiB: the defaults fetch as fixed knobs do;
- a part held by READER-THROTTLE (``store.retry``: 503 / 429 lowered the limit below the
  tuned one) grows nothing: throttling wins, and the scheduler sends at most
  ``min(max_requests, throttle.allowed)``;
- knobs never shrink within a pass: a reader that is slower than its link never stalls, so
  nothing grows, and memory stays within the cap either way. The next pass of the same
  process starts from what this one reached (per endpoint, as the budget does).

Only timing changes: items and parts are requested and consumed in the same order whatever
the knobs, so the data order is the same with or without tuning. Every decision is counted
(``metrics.COUNTERS``: ``budget.grown``, ``tuned.window``, ``tuned.max_requests``,
``tuned.part_size``) and each reader's current knobs are in ``metrics.READER_STATS``
(``knob.*``), both in ``loader.metrics()``. ``autotune=False`` keeps every knob fixed (the
budget too). The controller is pure (no clock of its own, no I/O); the prefetcher calls it on
its event loop (one thread): no lock.
"""

from __future__ import annotations

import dataclasses

from streamdata.config import FetchConfig
from streamdata.fetch.budget import Budget, distance
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
        self.decisions = dict.fromkeys(KNOBS, 0)
        self.part_size = self._part_for(self.budget.limit)
        self._first: list[float] = []  # the pass's first first-byte latencies (the far step)

    def knobs(self) -> dict[str, int]:
        """The knobs now, by ``KNOBS`` name."""
        return {"window": self.window, "max_requests": self.max_requests,
                "byte_budget": self.budget.limit, "part_size": self.part_size}

    def _part_for(self, budget: int) -> int:
        if not self.on:
            return self.most_part
        return max(self.least_part, min(self.most_part, budget // PARTS_IN_BUDGET))

    def _budget_moved(self) -> None:
        """The budget grew: counted, and the part size follows it (counted if it moved)."""
        self.decisions["byte_budget"] += 1
        part = self._part_for(self.budget.limit)
        if part != self.part_size:
            self.part_size = part
            self.decisions["part_size"] += 1

    @property
    def wants_first_byte(self) -> bool:
        """Whether the far step still waits for first bytes (``first_byte``): only the pass's
        first ``FAR_PARTS``, with tuning on."""
        return self.on and len(self._first) < FAR_PARTS

    def first_byte(self, latency: float) -> bool:
        """A part's first byte took ``latency`` s. The shortest of the pass's first ``FAR_PARTS``
        decides the far step (``far``): a server's cold first answer alone is not a far endpoint.
        True if a knob moved."""
        if not self.wants_first_byte:
            return False
        self._first.append(latency)
        return len(self._first) == FAR_PARTS and self.far(min(self._first))

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
        most = self.most_window if knob == "window" else self.most_requests
        if getattr(held, knob) != now or now >= most:
            return False
        setattr(self, knob, min(most, round(now * factor)))
        self.decisions[knob] += 1
        _learned[self.key] = (self.window, self.max_requests)
        return True

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
