"""Did a knob's growth raise the reader's throughput? Rates over windows of consumed bytes.

STEP-BACK (the rule, AUTOTUNE's hill-climb, ``tune``): growths of the window or the request
limit are judged after the fact, never delayed. A growth opens a *trial* (or joins the one
open: a burst of growths is judged as one). Its window is the byte budget then: one round of
what the budget keeps in flight, so that a rate spans a burst and the wait after it, not one
part. Its baseline is the reader's rate over the last window of bytes it consumed before the
trial's first growth (or over what it had consumed, if at least ``BASELINE`` of a window;
with less, the growth goes unjudged: the first stalls of a pass grow the knobs at once, as a
reader started low needs). The verdict comes once the reader has consumed two windows since
the trial's last growth: the first were requested under the old knobs (they settle), the rate
over the second is the trial's. The trial *raised* the throughput if that rate is at least
``1 + RISE`` times the baseline; if not, its knobs step back to their values before it, and
each stays there (hysteresis) until the reader has consumed ``HOLD`` windows more, doubled at
each consecutive failure of that knob: a knob can fail a trial again, but ever more rarely,
and never flips back and forth at the rate of stalls.

Judging a growth before taking it (no growth while a trial is open, none before a baseline)
was measured first and cost the climb from the smallest settings more than the steps back
gained (benchmarks/README.md, "Autotune"): a trial takes two budgets' worth of bytes.

The byte budget's growths are judged the same way (``Mark``): BUDGET-GROWTH's supply rule
(``budget``) grows the budget again only where its last growth raised the rate.

Everything is a pure function of the events it is given (bytes consumed at a time, growths):
no clock of its own. It runs on the prefetcher's event loop (one thread): no lock.
"""

from __future__ import annotations

import bisect
import dataclasses

__all__ = ["BASELINE", "HOLD", "RISE", "Climb", "Mark", "Meter"]

RISE = 0.05  # a growth raised the throughput if the rate after is this much above the rate before
BASELINE = 0.5  # a growth is judged against a rate over at least this share of its window
HOLD = 8  # a knob stepped back stays below the failed value for this many windows (doubled per failure)


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

    def due(self, total: int) -> bool:
        """Enough consumed since the growth for a verdict (the old knobs' bytes settled)."""
        return total >= self.at + 2 * self.window

    def rose(self, meter: Meter, now: float) -> bool | None:
        """Whether the rate after the growth rose ``RISE`` over the rate before; None: not yet
        known (too little consumed since). A growth with no baseline counts as risen."""
        if not self.due(meter.total):
            return None
        if self.before is None:
            return True
        after = meter.rate(self.window, now)
        return after is not None and after >= self.before * (1 + RISE)


@dataclasses.dataclass
class _Trial:
    mark: Mark
    before: dict[str, int]  # each grown knob's value before the growth


class Climb:
    """STEP-BACK for one prefetcher's window and request limit (the ``Tuner`` asks it)."""

    def __init__(self, most_window: int) -> None:
        self.meter = Meter()
        self._keep = 2 * most_window  # the meter's history: two of the longest windows
        self.trial: _Trial | None = None
        self._ceiling: dict[str, tuple[int, int]] = {}  # knob -> (value stepped back to, held until total)
        self._failed: dict[str, int] = {}  # knob -> consecutive failed trials
        self.kept = 0  # trials whose growth raised the throughput
        self.backs = 0  # trials whose growth did not: stepped back

    def mark(self, budget: int, now: float) -> Mark:
        """A growth now, under a byte budget of ``budget``: the window its rates span; the rate
        before over as much of one as was measured, if at least ``BASELINE`` of it, else none."""
        measured = min(budget, self.meter.measured())
        return Mark(self.meter.total, budget,
                    self.meter.rate(measured, now) if measured >= BASELINE * budget else None)

    def allows(self, knob: str, value: int) -> bool:
        """``knob`` may grow from ``value``: no hold after a failed trial keeps it there."""
        held = self._ceiling.get(knob)
        return held is None or value < held[0] or self.meter.total >= held[1]

    def grew(self, before: dict[str, int], budget: int, now: float) -> None:
        """The knobs in ``before`` grew now from those values, under a byte budget of
        ``budget``: a trial, if the rate before is known, or one more growth in the trial open
        (judged against its baseline, settled from now, stepped back to its first values)."""
        trial = self.trial
        if trial is not None:
            for knob, value in before.items():
                trial.before.setdefault(knob, value)
            trial.mark.at, trial.mark.window = self.meter.total, max(trial.mark.window, budget)
            return
        mark = self.mark(budget, now)
        if mark.before is not None:
            self.trial = _Trial(mark, dict(before))

    def released(self, nbytes: int, now: float) -> dict[str, int] | None:
        """The reader consumed ``nbytes`` at ``now``; the knobs to step back to, when a trial's
        verdict is that its growth did not raise the throughput."""
        self.meter.released(nbytes, now)
        self.meter.trim(self._keep)
        trial = self.trial
        if trial is None:
            return None
        rose = trial.mark.rose(self.meter, now)
        if rose is None:
            return None
        self.trial = None
        if rose:
            self.kept += 1
            for knob in trial.before:
                self._failed.pop(knob, None)
            return None
        self.backs += 1
        for knob, value in trial.before.items():
            fails = self._failed[knob] = self._failed.get(knob, 0) + 1
            self._ceiling[knob] = (value, self.meter.total + HOLD * trial.mark.window * 2 ** (fails - 1))
        return dict(trial.before)
