"""Token epochs: an epoch's token stream cut into whole sequences, and sequences to readers. Pure, no I/O.

An epoch's *token stream* is every unit's tokens (its documents, each with the optional
``bos``/``eos`` token around it), units in the epoch's seeded order (``sharding.epoch_order``).
The stream is cut into sequences of ``width`` tokens (``seq_len``, or ``seq_len + 1`` for
next-token targets), back to back, before anything is given to a reader:

Invariant (TOKENS-ONCE): every token of an epoch's stream lies in exactly one sequence, and every
sequence goes to exactly one reader (EXACTLY-ONCE of ``plan``'s spans, one sample = one
sequence), except the stream's one final partial sequence: dropped (``partial="drop"``,
its tokens counted) or padded to ``width`` (``partial="pad"``, the padding counted). So there
is at most one partial sequence per epoch, not one per reader: a reader's span of sequences is
a contiguous run of the stream whatever the world, and a position in it (sequences delivered)
is exact to the token. Readers' spans, EQUAL-STEPS and resume (RESUME-CONTINUES,
RESUME-ELASTIC) are ``plan`` and ``resume`` over one unit of ``sequences`` samples; this module
maps a span of sequences back to token ranges of units (``token_reads``) and a unit's token range
to the raw tokens to fetch (``raw_range``, ``augmented``).

Packing ``"fit"`` (``fit_plan``) cuts the stream at document boundaries, still into runs of
it; packing ``"best_fit"`` (``best_fit_plan``) packs each window of documents into sequences by
best fit, so a sequence is a list of whole documents (``pieces``), each still in exactly one
sequence, but the tail of a document longer than a sequence: left out, counted (``truncated``).

The sequence shuffle (``shuffle="sequences"``, :func:`with_blocks`): the stream's sequences are
grouped into *blocks* of ``block`` consecutive sequences (one ranged read each), and the epoch's
sequence of *positions* is the blocks in a seeded order (``rng([seed, epoch, BLOCK_TAG])``). So
the positions that ``plan`` and ``resume`` divide are still ``sequences`` samples, one per
sequence, given to ``resume_span`` as units of the blocks' sizes in that order
(``position_counts``): a segment of unit ``j`` is a run of sequences inside block
``blocks[j]`` (``stream_runs``), and TOKENS-ONCE holds as above (a permutation of whole
sequences). The reader's window shuffle over those blocks is ``blocks``' (BLOCK-SHUFFLE).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from streamdata.epoch.plan import Segment, segments_of
from streamdata.epoch.sharding import epoch_order

__all__ = ["BEST_FIT_WINDOW", "BLOCK_TAG", "SequencePlan", "TokenRead", "augmented", "augmented_mask",
           "best_fit_plan", "fit_plan", "raw_range", "sequence_plan", "token_reads", "unit_tokens",
           "with_blocks"]

BEST_FIT_WINDOW = 256  # packing "best_fit": documents packed together come from this many sequences' tokens
BLOCK_TAG = 0x5E0B  # seed material that sets the sequence blocks' order apart from the units'


class SequencePlan(NamedTuple):
    """One epoch's stream: units in order, where each ends (tokens), and its sequences."""

    order: np.ndarray
    ends: np.ndarray
    tokens: int  # the stream's length
    width: int  # tokens per sequence
    sequences: int  # whole sequences, plus the padded partial one with partial="pad"
    partial: int  # tokens of the stream's final partial sequence (0: none)
    bounds: np.ndarray | None = None  # packing "fit": where each sequence starts, and the end
    pieces: np.ndarray | None = None  # packing "best_fit": each sequence's documents, [n, 2] stream ranges
    firsts: np.ndarray | None = None  # ... where each sequence's pieces start in ``pieces``, and the end
    truncated: int = 0  # packing "best_fit": tokens of documents longer than a sequence left out
    block: int = 0  # shuffle="sequences": sequences per block (0: positions are the stream's order)
    blocks: np.ndarray | None = None  # the blocks in the epoch's order (``with_blocks``)

    @property
    def dropped(self) -> int:
        """Tokens of the epoch no sequence holds (the partial sequence, with partial="drop")."""
        if self.bounds is not None:
            return 0
        return self.tokens - min(self.tokens, self.sequences * self.width)

    def span_of(self, first: int, stop: int) -> tuple[int, int]:
        """Stream positions of sequences ``[first, stop)`` (one run: not for packing "best_fit")."""
        assert self.pieces is None, "a best-fit sequence is no run of the stream: token_reads"
        if self.bounds is not None:
            return int(self.bounds[first]), int(self.bounds[stop])
        return first * self.width, min(stop * self.width, self.tokens)

    def lengths(self, first: int, stop: int) -> np.ndarray:
        """Tokens of sequences ``[first, stop)`` before padding."""
        if self.pieces is not None and self.firsts is not None:
            held = np.concatenate([[0], np.cumsum(self.pieces[:, 1] - self.pieces[:, 0])])
            return np.diff(held[self.firsts[first:stop + 1]])
        if self.bounds is not None:
            return np.diff(self.bounds[first:stop + 1])
        ends = np.minimum(np.arange(first + 1, stop + 1) * self.width, self.tokens)
        return ends - np.arange(first, stop) * self.width

    def position_counts(self) -> np.ndarray:
        """The epoch's positions as ``resume_span``'s units: one of ``sequences`` samples, or the
        blocks' sizes in the epoch's block order (the sequence shuffle)."""
        if self.blocks is None:
            return np.array([self.sequences], dtype=np.int64)
        starts = self.blocks * self.block
        return np.minimum(starts + self.block, self.sequences) - starts

    def stream_runs(self, segments: Sequence[Segment]) -> list[tuple[int, int]]:
        """The stream's sequences ``[first, stop)`` that ``segments`` of positions (over
        ``position_counts``' units) hold, in order."""
        if self.blocks is None:
            return [(s.start, s.stop) for s in segments]
        firsts = [int(self.blocks[s.unit]) * self.block for s in segments]
        return [(first + s.start, first + s.stop) for first, s in zip(firsts, segments, strict=True)]


class TokenRead(NamedTuple):
    """Tokens ``[start, stop)`` of unit ``unit``; ``flush``: the last read of a run of sequences
    (a partial sequence left in the packer there is the epoch's final one: padded)."""

    unit: int
    start: int
    stop: int
    flush: bool


def unit_tokens(doc_counts: Sequence[int] | np.ndarray, raw_tokens: Sequence[int] | np.ndarray,
                specials: int) -> np.ndarray:
    """Tokens of each unit in the stream: its raw tokens and ``specials`` (0, 1 or 2) per document."""
    return np.asarray(raw_tokens, dtype=np.int64) + specials * np.asarray(doc_counts, dtype=np.int64)


def sequence_plan(tokens: Sequence[int] | np.ndarray, width: int, *, pad: bool, seed: int, epoch: int,
                  shuffle: bool) -> SequencePlan:
    """The epoch's stream for units of ``tokens[i]`` tokens, cut into sequences of ``width``."""
    counts = np.asarray(tokens, dtype=np.int64)
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle)
    ends = np.cumsum(counts[order])
    total = int(ends[-1]) if len(ends) else 0
    whole, partial = divmod(total, width)
    return SequencePlan(order, ends, total, width, whole + (1 if pad and partial else 0), partial)


def with_blocks(plan: SequencePlan, block: int, *, seed: int, epoch: int) -> SequencePlan:
    """``plan`` with its sequences' order shuffled by blocks of ``block`` consecutive sequences
    (see the module docstring): the blocks in the order ``rng([seed, epoch, BLOCK_TAG])`` draws."""
    n = -(-plan.sequences // block)
    order = np.random.default_rng([seed, epoch, BLOCK_TAG]).permutation(n).astype(np.int64)
    return plan._replace(block=int(block), blocks=order)


def fit_plan(tokens: Sequence[int] | np.ndarray, docs: Sequence[np.ndarray], width: int, specials: int, *,
             seed: int, epoch: int, shuffle: bool) -> SequencePlan:
    """The epoch's stream cut at document boundaries (packing ``"fit"``): each sequence takes the
    next whole documents while they fit in ``width`` (next fit, in stream order, so a sequence is
    still a contiguous run of the stream and a span of sequences one run of reads); a document
    longer than ``width`` is the one thing cut, into ``width``-token pieces. ``docs[i]``: unit
    ``i``'s documents' raw lengths; each is padded to ``width`` by the packer."""
    counts = np.asarray(tokens, dtype=np.int64)
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle)
    ends = np.cumsum(counts[order])
    total = int(ends[-1]) if len(ends) else 0
    lengths = (np.concatenate([docs[int(u)] for u in order]) + specials).tolist() if len(order) else []
    bounds, fill, at = [0], 0, 0
    for n in lengths:
        while n > 0:
            if fill and fill + n > width:  # close the sequence before this document
                bounds.append(at)
                fill = 0
            take = min(n, width - fill)  # (a piece of a document longer than a whole sequence)
            fill, at, n = fill + take, at + take, n - take
            if fill == width:
                bounds.append(at)
                fill = 0
    if fill:
        bounds.append(at)
    return SequencePlan(order, ends, total, width, len(bounds) - 1, 0, np.asarray(bounds, dtype=np.int64))


def best_fit_plan(tokens: Sequence[int] | np.ndarray, docs: Sequence[np.ndarray], width: int, specials: int,
                  *, seed: int, epoch: int, shuffle: bool, window: int = BEST_FIT_WINDOW) -> SequencePlan:
    """The epoch's documents packed whole into sequences by best fit (packing ``"best_fit"``):
    the stream's documents, in windows of about ``window`` sequences' tokens (in stream order),
    each packed by best fit decreasing: the longest first, each into the sequence it fills best
    (the least room left that holds it), a new sequence where none does. No document is cut: one
    longer than ``width`` keeps its first ``width`` tokens, the rest left out (``truncated``). A
    window's sequences come in the order of their first documents, each sequence's documents in
    stream order: a pure function of the documents, ``(seed, epoch)`` and ``width``. A sequence
    is no run of the stream but its ``pieces`` (a document each); each is padded to ``width``
    by the packer. ``docs[i]``: unit ``i``'s documents' raw lengths."""
    import bisect

    counts = np.asarray(tokens, dtype=np.int64)
    order = epoch_order(len(counts), seed=seed, epoch=epoch, shuffle=shuffle)
    ends = np.cumsum(counts[order])
    total = int(ends[-1]) if len(ends) else 0
    lengths = (np.concatenate([docs[int(u)] for u in order]).astype(np.int64) + specials if len(order)
               else np.zeros(0, np.int64))
    starts = np.cumsum(lengths) - lengths
    kept = np.minimum(lengths, width)
    block = (np.cumsum(kept) - kept) // max(window * width, 1)  # each document's window
    cuts = np.flatnonzero(np.diff(block)) + 1
    packed: list[int] = []  # the documents in their sequences' order
    firsts = [0]
    for members in np.split(np.arange(len(lengths)), cuts):
        members = members[kept[members] > 0]  # (an empty document with nothing inserted: no token)
        biggest = np.argsort(-kept[members], kind="stable")
        room: list[int] = []  # (room left << 32) + sequence, sorted: the best fit is the first that holds
        seqs: list[list[int]] = []
        for d, n in zip(members[biggest].tolist(), kept[members][biggest].tolist(), strict=True):
            k = bisect.bisect_left(room, n << 32)
            if k < len(room):
                key = room.pop(k)
                left, s = (key >> 32) - n, key & 0xFFFFFFFF
                seqs[s].append(d)
            else:
                s, left = len(seqs), width - n
                seqs.append([d])
            if left:
                bisect.insort(room, (left << 32) + s)
        for seq in sorted(sorted(s) for s in seqs):
            packed += seq
            firsts.append(len(packed))
    at = np.asarray(packed, dtype=np.int64)
    pieces = np.stack([starts[at], starts[at] + kept[at]], axis=1) if len(at) else np.zeros((0, 2), np.int64)
    return SequencePlan(order, ends, total, width, len(firsts) - 1, 0, None, pieces,
                        np.asarray(firsts, dtype=np.int64), int((lengths - kept).sum()))


def token_reads(plan: SequencePlan, segments: Sequence[Segment]) -> list[TokenRead]:
    """The unit token ranges that hold sequences ``segments`` (spans of ``plan``'s positions, as
    ``plan.reader_span`` / ``resume.resume_span`` give them over ``position_counts``), in order;
    a best-fit plan's in its sequences' order, a read per run of adjacent documents."""
    out: list[TokenRead] = []
    for first, last in plan.stream_runs(segments):
        if plan.pieces is not None and plan.firsts is not None:
            runs: list[list[int]] = []
            for a, b in plan.pieces[plan.firsts[first]:plan.firsts[last]].tolist():
                if runs and runs[-1][1] == a:
                    runs[-1][1] = b
                else:
                    runs.append([a, b])
            reads = [TokenRead(p.unit, p.start, p.stop, False) for a, b in runs
                     for p in segments_of(plan.order, plan.ends, a, b)]
            if reads:
                reads[-1] = reads[-1]._replace(flush=True)
            out += reads
            continue
        start, stop = plan.span_of(first, last)
        pieces = segments_of(plan.order, plan.ends, start, stop)
        for k, piece in enumerate(pieces):
            out.append(TokenRead(piece.unit, piece.start, piece.stop, k == len(pieces) - 1))
    return out


def _doc_starts(lengths: np.ndarray, specials: int) -> np.ndarray:
    """Where each document starts in its unit's stream (one more entry: the unit's end)."""
    return np.concatenate([[0], np.cumsum(lengths + specials)]).astype(np.int64)


def raw_range(lengths: np.ndarray, start: int, stop: int, bos: bool, eos: bool) -> tuple[int, int]:
    """The raw tokens (positions in the unit's documents laid back to back, without specials)
    that stream positions ``[start, stop)`` of a unit of documents of ``lengths`` need."""
    nb, specials = int(bos), int(bos) + int(eos)
    if stop <= start:
        return 0, 0
    starts = _doc_starts(lengths, specials)
    raw_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)

    def before(pos: int) -> int:  # raw tokens at stream positions before ``pos``
        d = min(max(int(np.searchsorted(starts, pos, side="right")) - 1, 0), len(lengths) - 1)
        return int(raw_starts[d] + min(max(pos - int(starts[d]) - nb, 0), int(lengths[d])))

    return before(start), before(stop)


def augmented(lengths: np.ndarray, start: int, stop: int, raw: np.ndarray, raw_from: int,
              bos_id: int | None, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Stream positions ``[start, stop)`` of a unit of documents of ``lengths``: its tokens (int64)
    and the index of the document each belongs to. ``raw`` holds the unit's raw tokens from
    ``raw_from`` on (at least ``raw_range``'s)."""
    nb, specials = int(bos_id is not None), int(bos_id is not None) + int(eos_id is not None)
    n = stop - start
    if specials == 0 and len(lengths) == 1:  # one document, nothing inserted: a plain slice
        return raw[start - raw_from:stop - raw_from].astype(np.int64), np.zeros(n, np.int64)
    starts = _doc_starts(lengths, specials)
    pos = np.arange(start, stop, dtype=np.int64)
    doc = np.searchsorted(starts, pos, side="right") - 1
    offset = pos - starts[doc] - nb
    raw_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    inside = (offset >= 0) & (offset < lengths[doc])
    out = np.empty(n, np.int64)
    out[inside] = raw[(raw_starts[doc] + offset)[inside] - raw_from]
    if bos_id is not None:
        out[offset < 0] = bos_id
    if eos_id is not None:
        out[offset >= lengths[doc]] = eos_id
    return out, doc



def augmented_mask(lengths: np.ndarray, start: int, stop: int, raw: np.ndarray, raw_from: int,
                   bos: bool, eos: bool) -> np.ndarray:
    """The loss mask (uint8, 1: a token to train on) of stream positions ``[start, stop)`` of a
    unit of documents of ``lengths``, as ``augmented`` lays out its tokens: a raw token's own;
    an inserted ``bos`` 0; an inserted ``eos`` its document's last token's (0 for an empty
    document: the end of a trained reply is learnt, that of a prompt not). ``raw``: the unit's
    raw mask from ``raw_from`` on (``raw_range``'s, and with ``eos`` the one before it)."""
    nb, specials = int(bos), int(bos) + int(eos)
    starts = _doc_starts(lengths, specials)
    pos = np.arange(start, stop, dtype=np.int64)
    doc = np.searchsorted(starts, pos, side="right") - 1
    offset = pos - starts[doc] - nb
    raw_starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.zeros(stop - start, np.uint8)
    inside = (offset >= 0) & (offset < lengths[doc])
    out[inside] = raw[(raw_starts[doc] + offset)[inside] - raw_from]
    if eos:
        ended = (offset >= lengths[doc]) & (lengths[doc] > 0)
        out[ended] = raw[(raw_starts[doc] + lengths[doc] - 1)[ended] - raw_from]
    return out
