"""STEP-BACK (streamdata/fetch/climb.py) and BUDGET-GROWTH's supply rule, driven as pure functions
of events: bytes consumed at given (fake) times, stalls, growths. No clock, no timing asserts."""

from __future__ import annotations

import pytest

from streamdata.config import FetchConfig
from streamdata.fetch import budget as budget_module
from streamdata.fetch import tune as tune_module
from streamdata.fetch.climb import BASELINE, HOLD, RISE, Climb, Meter
from streamdata.fetch.tune import Held, Tuner

MiB = 1 << 20
SMALLEST = {"window": 1, "max_requests": 1}


@pytest.fixture(autouse=True)
def _nothing_learned():
    budget_module._learned.clear()
    tune_module._learned.clear()
    yield
    budget_module._learned.clear()
    tune_module._learned.clear()


class Reader:
    """A reader that consumes a MiB at a time at a given rate, on a fake clock."""

    def __init__(self, tuner: Tuner) -> None:
        self.t, self.now, self.moves = tuner, 0.0, 0

    def consume(self, nbytes: int, rate: float) -> None:
        for _ in range(nbytes // MiB):
            self.now += MiB / rate
            self.moves += self.t.released(MiB, now=self.now)

    def stall(self, held: Held, latency: float | None = None) -> bool:
        return self.t.stalled(held, latency, now=self.now)


def test_the_meter_takes_rates_over_consumed_bytes():
    m = Meter()
    assert m.rate(MiB, 0.0) is None
    now = 0.0
    for _ in range(8):  # 8 MiB at 10 MiB/s, then 8 MiB at 40 MiB/s
        now += 0.1
        m.released(MiB, now)
    for _ in range(8):
        now += 0.025
        m.released(MiB, now)
    assert m.rate(8 * MiB, now) == pytest.approx(40 * MiB)  # the last 8 MiB only
    assert m.rate(16 * MiB, now) is None  # the first MiB's start is not known: 15 MiB are measured
    assert m.rate(15 * MiB, now) == pytest.approx(15 * MiB / (now - 0.1))
    assert m.rate(8 * MiB, now + 0.2) == pytest.approx(8 * MiB / 0.4)  # a wait since counts
    assert m.rate(32 * MiB, now) is None  # not that much consumed yet


def test_a_growth_that_raised_the_throughput_is_kept():
    t = Tuner(FetchConfig(byte_budget=8 * MiB, max_requests=8, tune_from=SMALLEST))
    r = Reader(t)
    r.consume(12 * MiB, 10e6)  # a baseline
    assert r.stall(Held(window=1, max_requests=1)) and (t.window, t.max_requests) == (4, 4)
    assert t.climb.trial is not None and t.climb.trial.before == {"window": 1, "max_requests": 1}
    r.consume(MiB, 10e6)
    assert r.stall(Held(window=4, max_requests=4))  # never delayed: it joins the trial open
    assert (t.window, t.max_requests) == (16, 8) and t.climb.trial.before == {"window": 1, "max_requests": 1}
    r.consume(2 * 8 * MiB, 30e6)  # it settles, then the rate is three times the baseline
    assert t.climb.trial is None and t.climb.kept == 1 and r.moves == 0
    assert (t.window, t.max_requests) == (16, 8) and t.decisions["back"] == 0


def test_a_growth_that_did_not_raise_the_throughput_steps_back_and_is_held_ever_longer():
    """On a server that two more requests do not speed up (a loopback sharing the client's cores),
    a growth comes back; it is tried again only after HOLD windows, then after twice as many:
    never a flip at each stall."""
    t = Tuner(FetchConfig(byte_budget=8 * MiB, max_requests=8, tune_from=SMALLEST), key="k")
    r = Reader(t)
    r.consume(12 * MiB, 50e6)
    assert r.stall(Held(window=1, max_requests=1)) and (t.window, t.max_requests) == (4, 4)
    r.consume(2 * 8 * MiB - MiB, 50e6)
    assert (t.window, t.max_requests) == (4, 4)  # no verdict before two windows: the old knobs settle
    r.consume(MiB, 50e6)  # the same rate: not RISE above
    assert (t.window, t.max_requests) == (1, 1) and r.moves == 1
    assert t.decisions == {"window": 2, "max_requests": 2, "byte_budget": 0, "part_size": 0, "back": 1}
    assert tune_module._learned["k"] == (1, 1)  # the next pass starts where this one stepped back to
    hold = HOLD * 8 * MiB
    r.consume(hold - MiB, 50e6)
    assert not r.stall(Held(window=1, max_requests=1))  # held
    r.consume(MiB, 50e6)
    assert r.stall(Held(window=1, max_requests=1))  # tried again
    r.consume(2 * 8 * MiB, 50e6 * (1 + RISE / 2))  # a little faster, within RISE: not risen
    assert (t.window, t.max_requests) == (1, 1) and t.decisions["back"] == 2
    r.consume(hold, 50e6)
    assert not r.stall(Held(window=1, max_requests=1))  # twice as long now
    r.consume(hold, 50e6)
    assert r.stall(Held(window=1, max_requests=1))


def test_a_knob_that_slows_the_reader_is_tried_rarely_over_a_long_pass():
    """A whole pass at a rate no knob changes, stalling at every part: the trials (and their
    steps back) are a few, however long the pass."""
    t = Tuner(FetchConfig(byte_budget=8 * MiB, max_requests=32, tune_from=SMALLEST))
    r = Reader(t)
    r.consume(12 * MiB, 50e6)  # no stall at first: a baseline
    for _ in range(4096):  # 4 GiB, a stall at every MiB
        r.consume(MiB, 50e6)
        r.stall(Held(window=t.window, max_requests=t.max_requests))
    assert 1 <= t.decisions["back"] <= 7  # holds of 8, 16, 32, ... windows of 8 MiB
    assert t.decisions["back"] == t.climb.backs and t.climb.kept == 0
    assert (t.window, t.max_requests) == (1, 1) or t.climb.trial is not None  # back, or in a trial


def test_a_growth_before_a_baseline_goes_unjudged_and_a_step_back_keeps_to_the_bounds():
    """A stall before BASELINE of a window (the budget: 8 MiB) consumed grows the knobs at once,
    unjudged (a reader started low needs it). A step back goes to the values before the judged
    growth: never below the start, never past the bounds."""
    t = Tuner(FetchConfig(byte_budget=8 * MiB, window=16, max_requests=2, tune_from=SMALLEST))
    r = Reader(t)
    assert r.stall(Held(window=1, max_requests=1)) and (t.window, t.max_requests) == (4, 2)
    assert t.climb.trial is None
    r.consume(int(BASELINE * 8 * MiB) + MiB, 1e6)  # the first MiB starts the clock
    assert r.stall(Held(window=4, max_requests=2)) and (t.window, t.max_requests) == (16, 2)
    assert t.climb.trial is not None and t.climb.trial.mark.before == pytest.approx(1e6)
    r.consume(64 * MiB, 1e6)
    assert (t.window, t.max_requests) == (4, 2) and t.decisions["back"] == 1
    assert t.decisions["window"] == 3 and t.decisions["max_requests"] == 1
    far = Tuner(FetchConfig(byte_budget=8 * MiB, tune_from=SMALLEST), key="far")
    assert far.far(0.25, now=0.0) and (far.window, far.max_requests) == (4, 4)  # no baseline needed
    assert far.climb.trial is None


def test_autotune_off_measures_nothing_and_steps_nothing():
    t = Tuner(FetchConfig(autotune=False, tune_from=SMALLEST))
    r = Reader(t)
    r.consume(64 * MiB, 10e6)
    assert not r.stall(Held(window=32, max_requests=32)) and r.moves == 0 and t.climb.meter.total == 0


def _budget_bound(t: Tuner, r: Reader, cycles: int, latency: float, rises: bool) -> None:
    """A reader the budget holds back at a far endpoint: every 8 one-way delays it gets the
    budget's worth (``rises``: its rate follows the budget; else the link caps it at 8 MiB a
    cycle), and it waits for parts the budget held at every MiB. Its rate times the latency is
    an eighth of the budget: under LATENCY_SHARE, the product rule alone never grows it."""
    for _ in range(cycles):
        rate = (t.budget.limit if rises else 8 * MiB) / (8 * latency)
        for _ in range(4):
            r.consume(MiB, rate)
            r.stall(Held(budget=t.budget.limit), latency)


def test_the_budget_grows_while_it_limits_the_supply_and_the_rate_follows():
    """From 8 MiB at 250 ms one-way: the product (rate x first-byte latency) stays an eighth of
    the budget, since the budget sets the rate; the far step, then the supply rule (the last
    growth raised the rate) take it to the cap."""
    t = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST))
    r = Reader(t)
    assert t.far(0.25, now=0.0) and t.budget.limit == 16 * MiB
    _budget_bound(t, r, 64, 0.25, rises=True)
    assert t.budget.limit == 128 * MiB and t.part_size == 8 * MiB
    assert t.decisions["byte_budget"] == t.budget.grown == 3  # far 16, supply 64, supply 128 (the cap)


def test_the_supply_rule_stops_where_growth_did_not_raise_the_rate():
    t = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB, tune_from=SMALLEST))
    r = Reader(t)
    assert t.far(0.25, now=0.0)
    _budget_bound(t, r, 64, 0.25, rises=False)  # the link, not the budget, sets the rate
    assert t.budget.limit == 64 * MiB and t.budget.grown == 2  # the far step's one, then no more


def test_a_near_endpoint_never_grows_its_budget_by_the_supply_rule():
    """No growth to judge (no far step, the product small): stalls alone grow no budget."""
    t = Tuner(FetchConfig(byte_budget=8 * MiB, byte_budget_max=128 * MiB))
    r = Reader(t)
    assert not t.far(0.001, now=0.0)
    for _ in range(256):
        r.consume(MiB, 200e6 * (1 + r.now))  # ever faster: rising is not enough without a growth
        assert not r.stall(Held(budget=t.budget.limit), 0.002)
    assert t.budget.limit == 8 * MiB and t.budget.grown == 0


def test_the_climb_alone_judges_and_holds():
    c = Climb(8 * MiB)
    c.grew({"window": 1}, 4 * MiB, 0.0)
    assert c.trial is None  # no baseline yet: unjudged
    now = 0.0
    for _ in range(8):
        now += 0.1
        assert c.released(MiB, now) is None
    c.grew({"window": 4}, 4 * MiB, now)
    assert c.trial is not None and c.trial.mark.before == pytest.approx(MiB / 0.1)
    c.grew({"window": 16, "max_requests": 1}, 4 * MiB, now)  # joins it
    assert c.trial.before == {"window": 4, "max_requests": 1}
    for _ in range(7):
        now += 0.1
        assert c.released(MiB, now) is None  # under two windows of 4 MiB since
    now += 0.1
    assert c.released(MiB, now) == {"window": 4, "max_requests": 1} and c.backs == 1  # the same rate
    assert not c.allows("window", 4) and not c.allows("max_requests", 1) and c.allows("window", 1)
    for _ in range(HOLD * 4):
        now += 0.1
        c.released(MiB, now)
    assert c.allows("window", 4)


def test_every_decision_has_a_counter():
    """Each of the tuner's decisions (a step back too) is added to a counter of ``COUNTERS``."""
    from streamdata.fetch.prefetcher import _DECISION
    from streamdata.metrics import COUNTERS

    assert set(_DECISION) == set(Tuner(FetchConfig()).decisions)
    assert set(_DECISION.values()) <= set(COUNTERS) and "tuned.back" in _DECISION.values()
