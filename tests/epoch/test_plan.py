"""Exact epochs (plan.py): every sample once, spans equal within one, equal steps on every rank.

Exhaustive over small cases: shard-count vectors, ranks 1-5, workers 0-3 (0 reads in the main
process: one reader per rank), batch sizes 1-7 and none, with and without drop_last.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from streamdata.epoch.plan import Segment, batch_sizes, reader_span
from streamdata.epoch.world import World

COUNT_VECTORS = [[], [0], [1], [5], [0, 0, 3], [5, 1, 9, 3, 0, 7, 2], [2, 2, 2, 2], [64] * 17,
                 [10, 200, 37, 150, 11, 99, 120, 13, 54, 180, 77, 61, 42], [1] * 11, [3, 0, 0, 1]]


def _spans(counts, ranks, workers, **kw):
    readers = max(workers, 1)
    return {(r, w): reader_span(counts, World(r, ranks, w, readers), **kw)
            for r in range(ranks) for w in range(readers)}


def _samples(counts, span):
    out = []
    for seg in span.segments:
        assert 0 <= seg.start < seg.stop <= counts[seg.unit]
        out += [(seg.unit, i) for i in range(seg.start, seg.stop)]
    return out


CASES = list(itertools.product(range(len(COUNT_VECTORS)), range(1, 6), range(0, 4),
                               [None, *range(1, 8)], [False, True]))


@pytest.mark.parametrize("case", range(0, len(CASES), 1 + len(CASES) // 600))
def test_exact_epochs_property(case):
    _check(case)


@pytest.mark.slow
def test_exact_epochs_property_every_case():
    for case in range(len(CASES)):
        _check(case)


def _check(case):
    vector, ranks, workers, batch, drop_last = CASES[case]
    counts = COUNT_VECTORS[vector]
    for epoch, shuffle in ((0, False), (3, True)):
        spans = _spans(counts, ranks, workers, seed=7, epoch=epoch, shuffle=shuffle,
                       batch_size=batch, drop_last=drop_last)
        everything = Counter((u, i) for u, n in enumerate(counts) for i in range(n))
        got = Counter(s for span in spans.values() for s in _samples(counts, span))
        pads = sum(span.pad for span in spans.values())
        dropped = {span.dropped for span in spans.values()}
        assert len(dropped) == 1
        if drop_last and batch:
            assert got <= everything and max(got.values(), default=1) == 1
            assert sum(everything.values()) - sum(got.values()) == dropped.pop()
            assert sum(everything.values()) - sum(got.values()) < len(spans) * batch
            assert {span.samples for span in spans.values()} <= {spans[0, 0].samples}
            assert all(set(batch_sizes(s, batch)) <= {batch} for s in spans.values())
        else:
            assert dropped == {0}
            extra = got - everything
            assert got - extra == everything and sum(extra.values()) == pads  # once each, but pads
            own = [span.samples - span.pad for span in spans.values()]
            assert max(own) - min(own) <= 1  # spans equal within one sample
        if batch is not None:
            steps = Counter()
            for (r, _), span in spans.items():
                sizes = batch_sizes(span, batch)
                assert len(sizes) == span.batches and sum(sizes) == span.samples
                assert all(1 <= s <= batch for s in sizes)
                assert sizes[:-2] == [batch] * len(sizes[:-2])  # only the last two may be short
                steps[r] += len(sizes)
            assert len(set(steps.values())) == 1, steps  # EQUAL-STEPS
            if not drop_last and pads:
                assert batch == 1 or min(own) == 0  # repeats only where splitting cannot help


def test_spans_are_contiguous_in_slot_order_and_cross_units():
    counts = [5, 1, 9, 3, 0, 7, 2]
    spans = _spans(counts, 2, 2, batch_size=None)
    flat = [s for key in sorted(spans) for s in _samples(counts, spans[key])]
    assert flat == [(u, i) for u, n in enumerate(counts) for i in range(n)]
    # 27 samples over 4 readers: 7, 7, 7, 6; the extras to worker 0 of each rank, then worker 1
    assert spans[0, 0].segments == (Segment(0, 0, 5), Segment(1, 0, 1), Segment(2, 0, 1))
    assert spans[0, 1].segments == (Segment(2, 1, 8),)  # starts and ends inside shard 2
    assert [spans[k].samples for k in sorted(spans)] == [7, 7, 7, 6]


def test_the_left_out_samples_differ_between_epochs():
    counts = [64] * 17 + [5]  # 1093 samples, 32 per round of full batches: 5 left out
    left_out = []
    for epoch in range(4):
        spans = _spans(counts, 2, 2, epoch=epoch, batch_size=8, drop_last=True)
        got = {s for span in spans.values() for s in _samples(counts, span)}
        left_out.append(frozenset((u, i) for u, n in enumerate(counts) for i in range(n)) - got)
    assert all(len(x) == len(left_out[0]) > 0 for x in left_out) and len(set(left_out)) == 4


def test_the_issues_three_cases_give_equal_steps_without_dropping_anything():
    for counts in ([5, 1, 9, 3, 0, 7, 2], [10, 200, 37, 150, 11, 99, 120, 13, 54, 180, 77, 61, 42],
                   [64] * 17):
        spans = _spans(counts, 2, 2, batch_size=8)
        steps = Counter()
        for (r, _), span in spans.items():
            steps[r] += span.batches
            assert span.pad == 0
        assert steps[0] == steps[1]


def test_a_reader_plans_its_share_of_a_million_units():
    counts = np.random.default_rng(0).integers(50, 150, 1_000_000)
    span = reader_span(counts, World(1234, 4096, 5, 8), seed=1, epoch=2, shuffle=True, batch_size=32)
    assert abs(span.samples - counts.sum() / (4096 * 8)) <= 1
    assert len(span.segments) <= span.samples // 50 + 2 and span.batches == -(-span.samples // 32)
