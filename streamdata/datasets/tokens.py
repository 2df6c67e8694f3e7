"""``sd.TokenDataset``: pre-tokenized corpora packed into ``[batch, seq_len]`` blocks, exact and resumable.

Sources: flat ``.bin`` token arrays (``dtype=``, or a ``tokens.json`` beside them; nanoGPT),
``.bin`` + ``.idx`` pairs (Megatron; the ``.idx`` beside each ``.bin`` gives the dtype and the
documents), a Parquet list column of token ids (``column=``), and tar shards whose samples each
hold a 1-D integer ``.npy`` (``field=``; WebDataset style). Token counts come from metadata,
read once on rank 0 (LIST-ONCE): the listing's ``.bin`` sizes, the ``.idx`` files, the Parquet
footers (a list column's value count less its null count, per row group); a tar shard has no
such metadata, so the constructor's counting pass reads each shard once per job, each rank a
share of the shards (COUNT-SHARED in ``catalog.tokens``; its samples' ``.npy`` headers and byte
offsets). The epoch's stream is cut into whole sequences
before readers get spans of them (TOKENS-ONCE in ``epoch.tokens``), so a reader's position is
a number of sequences: resume (same or another world) is ``resume``'s, exact to the token.

A unit is one ``.bin`` file (read in byte ranges: only the tokens of the reader's span), one
Parquet row group (its token column chunk) or one tar shard (read in byte ranges: only the
samples of the reader's span, from the counting pass's offsets). See docs/tokens.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from streamdata._fork import install
from streamdata.batch.batches import batches
from streamdata.batch.tokens import pack
from streamdata.catalog.footers import read_footers, with_sizes
from streamdata.catalog.specs import Spec
from streamdata.catalog.tokens import (
    SIDECAR,
    count_tar_tokens,
    default_counts_url,
    read_indexes,
    save_tar_counts,
    sidecar_dtype,
)
from streamdata.datasets.passes import EpochIterator, Read, ReaderPass
from streamdata.datasets.sharded import ShardedDataset
from streamdata.epoch.plan import SampleSlice
from streamdata.epoch.resume import Stage, resume_span
from streamdata.epoch.state import fingerprint
from streamdata.epoch.tokens import (
    SequencePlan,
    augmented,
    fit_plan,
    raw_range,
    sequence_plan,
    token_reads,
    unit_tokens,
)
from streamdata.errors import FormatError, ShardNotFoundError, SpecError
from streamdata.fetch.prefetcher import FetchItem, ItemReader
from streamdata.formats import arrow as fmt
from streamdata.formats.tokens import tar_tokens, token_dtype, tokens_of
from streamdata.policy import ErrorPolicy
from streamdata.ranks import from_rank0
from streamdata.redact import redact_url
from streamdata.store.urls import Shard

__all__ = ["TokenDataset", "TokenUnit"]

PARTIAL = ("drop", "pad")


@dataclass(frozen=True)
class TokenUnit:
    """One unit of a token corpus: a ``.bin`` file (``index`` -1) or a Parquet row group;
    ``docs`` documents from global document ``first_doc`` on, ``tokens`` raw tokens."""

    url: str
    size: int
    index: int
    docs: int
    tokens: int
    first_doc: int
    i: int  # its place in the dataset's units


class TokenDataset(ShardedDataset):
    """Token ids packed into sequences of ``seq_len`` tokens (``seq_len + 1`` with
    ``targets=True``), yielded as ``{"input_ids": LongTensor[B, width]}`` batches of
    ``batch_size`` sequences (one ``[width]`` sequence at a time with ``batch_size=None``).

    The source: ``column=`` a Parquet list column of integer token ids (one row, one document);
    ``field=`` tar shards, each sample's ``field`` (e.g. ``"npy"``) a 1-D integer ``.npy`` (one
    sample, one document; counted by reading each shard once in the constructor, each rank a
    share, with a bar of rank 0's on stderr when it is a terminal or ``progress=True``;
    ``save_counts()`` keeps the counts for later jobs, which read them from ``counts``:
    ``"auto"``, beside the shards, or a URL, or ``None``: count always); else ``.bin`` files:
    ``dtype=`` flat token arrays (one file, one document), or, without ``dtype``, flat arrays of
    the dtype that a ``tokens.json`` (``{"dtype": "uint16"}``) beside them names, or else (or with
    ``idx=True``) Megatron ``.bin`` + ``.idx`` pairs. ``bos_id`` / ``eos_id``:
    inserted around every document. ``partial``: the epoch's final partial sequence is
    ``"drop"``-ped (its tokens counted in ``counts["tokens.dropped"]``) or ``"pad"``-ded with
    ``pad_id`` (``counts["tokens.padded"]``). ``documents=True`` adds ``doc_ids``,
    ``position_ids`` and ``cu_seqlens`` (``batch.tokens``); in a flat ``.bin``, ``sep_id`` (e.g.
    GPT-2's ``50256``) ends each document there. ``packing="fit"``: a document shorter than a
    sequence is never cut (``epoch.tokens.fit_plan``; sequences padded). ``shuffle=True`` shuffles the
    units' order per epoch (seeded); ``drop_last``, ``seed``, fetch and storage options as for
    the other sharded datasets. Every token of an epoch in exactly one sequence, every rank the
    same number of steps (TOKENS-ONCE, EQUAL-STEPS); ``state_dict`` is exact to the token.
    """

    def __init__(self, urls: Spec, seq_len: int, batch_size: int | None = None, *,
                 column: str | None = None, dtype: Any = None, idx: bool | None = None,
                 targets: bool = False, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int = 0, partial: str = "drop", documents: bool = False,
                 sep_id: int | None = None, packing: str = "concat", footer_bytes: int = 64 * 1024,
                 field: str | None = None, progress: bool | None = None, counts: str | None = "auto",
                 **options: Any) -> None:
        if not isinstance(seq_len, int) or seq_len < 1:
            raise SpecError(f"seq_len must be a positive int, got {seq_len!r}")
        if partial not in PARTIAL:
            raise SpecError(f"partial must be 'drop' or 'pad', got {partial!r}")
        for name in ("shuffle_buffer", "shuffle_window", "collate_fn"):
            if options.get(name) is not None:
                raise SpecError(f"TokenDataset takes no {name}: shuffle=True shuffles its units' order; "
                                "sequences are batched as they are packed")
        if options.get("shuffle") not in (None, False, True):
            raise SpecError(f"TokenDataset: shuffle is True or False (the units' order), got "
                            f"{options['shuffle']!r}")
        if options.get("on_error", "raise") != "raise":
            raise SpecError("TokenDataset reads every token of its plan: on_error must be 'raise' "
                            "(a skipped unit would break the epoch's token accounting)")
        self.layout = "parquet" if column is not None else "tar" if field is not None else (
            "idx" if idx or (idx is None and dtype is None) else "bin")
        if column is not None and (dtype is not None or idx or field is not None):
            raise SpecError("TokenDataset: column= reads Parquet; dtype= and idx= are for .bin files, "
                            "field= for tar shards")
        if field is not None and (dtype is not None or idx):
            raise SpecError("TokenDataset: field= reads tar shards (each sample's .npy gives its dtype); "
                            "dtype= and idx= are for .bin files")
        self.suffixes = {"parquet": (".parquet", ".pq", ".parq"), "tar": (".tar",)}.get(self.layout,
                                                                                         (".bin",))
        self.column = column
        self.field = None if field is None else field.lower()  # (tar field names are read lower-case)
        self.progress = progress
        self._counts_option = counts
        self.counted_shards = 0  # tar shards the job's counting pass read (every rank's share)
        self.counted_here = 0  # those this rank read (COUNT-SHARED, ``catalog.tokens``)
        self._tar_counts: list[tuple[np.ndarray, np.ndarray]] = []
        self._sniff = dtype is None and idx is None  # .idx or tokens.json: whichever is there
        self.dtype = None if dtype is None else token_dtype(dtype)
        self.seq_len, self.width = seq_len, seq_len + int(bool(targets))
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, int(pad_id)
        self.specials = int(bos_id is not None) + int(eos_id is not None)
        self.partial, self.documents, self.footer_bytes = partial, bool(documents), footer_bytes
        if sep_id is not None and self.layout not in ("bin", "idx") or sep_id is not None and idx:
            raise SpecError("sep_id marks documents in flat .bin files (dtype=); the .idx and Parquet rows "
                            "already say where documents end")
        self.sep_id = sep_id
        if packing not in ("concat", "fit"):
            raise SpecError(f"packing must be 'concat' or 'fit', got {packing!r}")
        if packing == "fit" and column is not None:
            raise SpecError("packing='fit' needs every document's length before reading: .bin + .idx "
                            "(or flat .bin, one document per file); a Parquet column's are known only "
                            "when its row groups are read")
        self.packing = packing
        super().__init__(urls, batch_size=batch_size, shuffle_buffer=0, **options)
        self.shards = from_rank0(lambda: with_sizes(self.shards, self.storage_options, self.fetch_config))
        self._lengths: list[np.ndarray | None] = []  # documents' raw tokens per unit (None: read)
        self._offsets: dict[str, np.ndarray] = {}  # a tar shard's samples' byte offsets
        self._footers: dict[str, bytes] = {}
        self._meta_cache: dict[str, Any] = {}
        self._fit: tuple[tuple, SequencePlan] | None = None  # packing "fit": the last epoch's plan
        self.units_: list[TokenUnit] = self._scan()
        if sep_id is not None and self.layout != "bin":
            raise SpecError(f"sep_id marks documents in flat .bin files; {redact_url(self.shards[0].url)} "
                            "has a .idx, which already says where documents end")
        self._tokens = unit_tokens([u.docs for u in self.units_], [u.tokens for u in self.units_],
                                   self.specials)

    # ---- what the metadata says ------------------------------------------------------------

    def _scan(self) -> list[TokenUnit]:
        """The units and their documents, from the listing, the ``.idx`` files or the footers."""
        units: list[TokenUnit] = []
        docs = 0

        def add(url: str, size: int, index: int, tokens: int, lengths: np.ndarray | None,
                n_docs: int) -> None:
            nonlocal docs
            if tokens + n_docs * self.specials == 0 or (tokens == 0 and index < 0 and self.layout != "tar"):
                return  # nothing in the stream (an empty .bin holds no documents; a tar's empty samples do)
            units.append(TokenUnit(url, size, index, n_docs, tokens, docs, len(units)))
            self._lengths.append(lengths)
            docs += n_docs

        if self._sniff:  # no dtype=, no idx=: a tokens.json beside flat .bin files, else .idx files
            sidecar = sidecar_dtype(self.shards, self.storage_options, self.fetch_config)
            if sidecar is not None:
                self.layout, self.dtype = "bin", sidecar
        if self.layout == "bin":
            assert self.dtype is not None
            for shard in self.shards:
                size = _size(shard)
                if size % self.dtype.itemsize:
                    raise FormatError(f"{redact_url(shard.url)}: {size} bytes is not a whole number of "
                                      f"{self.dtype} tokens (truncated, or another dtype?)", url=shard.url,
                                      key="bin")
                n = size // self.dtype.itemsize
                add(shard.url, size, -1, n, np.array([n], np.int64), 1)
        elif self.layout == "tar":
            assert self.field is not None
            url = default_counts_url(self.shards) if self._counts_option == "auto" else self._counts_option
            self._tar_counts, self.counted_shards, self.counted_here = count_tar_tokens(
                self.shards, self.field, self.storage_options, self.fetch_config, show=self.progress,
                counts_url=url, auto=self._counts_option == "auto")
            for shard, (counts, offsets) in zip(self.shards, self._tar_counts, strict=True):
                self._offsets[shard.url] = offsets
                add(shard.url, _size(shard), -1, int(counts.sum()), counts, len(counts))
        elif self.layout == "idx":
            try:
                indexes = read_indexes(self.shards, self.storage_options, self.fetch_config)
            except ShardNotFoundError as exc:
                if self._sniff:  # neither dtype= nor a tokens.json nor the .idx files: say how to fix
                    exc.message += (f"; a flat .bin needs its token dtype: pass dtype= (e.g. 'uint16') or "
                                    f"put a {SIDECAR} beside the files holding {{\"dtype\": \"uint16\"}}")
                raise
            for shard, (dtype, lengths) in zip(self.shards, indexes, strict=True):
                if self.dtype is not None and dtype != self.dtype:
                    raise SpecError(f"{redact_url(shard.url)}: its .idx says {dtype} tokens, dtype= says "
                                    f"{self.dtype}")
                self.dtype = dtype
                add(shard.url, _size(shard), -1, int(lengths.sum()), lengths, len(lengths))
        else:
            for shard in self.shards:
                meta = self._meta(shard.url)
                leaf = self._leaf(meta, shard.url)
                for g in range(meta.num_row_groups):
                    rg = meta.row_group(g)
                    cc = rg.column(leaf)
                    stats = cc.statistics if cc.is_stats_set else None
                    nulls = stats.null_count if stats is not None and stats.has_null_count else 0
                    add(shard.url, _size(shard), g, int(cc.num_values - nulls), None, rg.num_rows)
        if not units:
            raise SpecError(f"no tokens in {len(self.shards)} objects, e.g. {redact_url(self.shards[0].url)}")
        return units

    def _meta(self, url: str) -> Any:
        if not self._footers:
            self._footers = from_rank0(lambda: read_footers(
                self.shards, self.storage_options, self.fetch_config, tail_bytes=self.footer_bytes,
                footer_length=lambda tail, s: fmt.parquet_footer_length(tail, _size(s), s.url),
                policy=ErrorPolicy("raise")))
        meta = self._meta_cache.get(url)
        if meta is None:
            meta = self._meta_cache[url] = fmt.parse_parquet_footer(self._footers[url], url)
        return meta

    def _leaf(self, meta: Any, url: str) -> int:
        """The one leaf of the token column; SpecError unless it is a list of integers."""
        assert self.column is not None
        leaves = fmt.parquet_leaves(meta, [self.column], url)
        field = meta.schema.to_arrow_schema().field(self.column)
        kind = field.type
        listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if not listed or not pa.types.is_integer(kind.value_type):
            raise SpecError(f"column {self.column!r} of {redact_url(url)} is {kind}, not a list of integer "
                            "token ids (e.g. list<int32>)")
        return leaves[0]

    def save_counts(self, url: str | None = None) -> str:
        """Keep a tar corpus's counts (what the constructor's counting pass found) at ``url``
        (default: ``_streamdata.tokens.npz`` in the shards' common directory), so that later
        constructors (``counts="auto"`` or that URL) read only shards that are new or changed
        (size or ETag); returns the URL written. Call it on one rank."""
        if self.layout != "tar":
            raise SpecError("save_counts keeps the counts of tar shards (field=); the other layouts' "
                            "counts are metadata already")
        url = url or default_counts_url(self.shards)
        if url is None:
            raise SpecError("the shards share no directory: pass save_counts the counts file's URL")
        assert self.field is not None
        save_tar_counts(url, self.field, self.shards, self._tar_counts, self.storage_options,
                        self.fetch_config)
        return url

    # ---- what ShardedDataset asks ----------------------------------------------------------

    def units(self) -> Sequence[Any]:
        return self.units_

    def sample_counts(self) -> np.ndarray:
        """The epoch's samples: its sequences, as one unit (the stream, ``epoch.tokens``); what a
        Mix divides (a mix of token sources is a mix of sequences of the same width)."""
        return np.array([self.plan(0).sequences], dtype=np.int64)

    def block_window(self) -> int | None:
        return None  # shuffle=True orders units; sequences stay in stream order

    def state_key(self) -> tuple[str, str]:
        key = (self.seed, self.shuffle)
        if self._state_key is None or self._state_key[0] != key:
            fp = fingerprint(self.shards, [*self._tokens.tolist(), self.width, self.specials,
                                           PARTIAL.index(self.partial), int(self.packing == "fit")],
                             seed=self.seed, shuffle=self.shuffle)
            self._state_key = (key, (fp, "samples"))
        return self._state_key[1]

    def plan(self, epoch: int | None = None) -> SequencePlan:
        """The epoch's stream and its sequences (``epoch.tokens``)."""
        epoch = self.epoch if epoch is None else epoch
        if self.packing == "fit":  # (a walk over every document: kept for the epoch)
            key = (epoch, self.seed, self.shuffle)
            if self._fit is None or self._fit[0] != key:
                docs = [self._doc_lengths(u) for u in self.units_]
                self._fit = (key, fit_plan(self._tokens, docs, self.width, self.specials, seed=self.seed,
                                           epoch=epoch, shuffle=self.shuffle))
            return self._fit[1]
        return sequence_plan(self._tokens, self.width, pad=self.partial == "pad", seed=self.seed,
                             epoch=epoch, shuffle=self.shuffle)

    @property
    def num_tokens(self) -> int:
        """Tokens in one epoch's stream (inserted ``bos``/``eos`` included)."""
        return int(self._tokens.sum())

    @property
    def num_sequences(self) -> int:
        """Sequences in one epoch, over every reader (``len()`` is this rank's batches: ``steps``)."""
        return self.plan().sequences

    def _plan_pass(self, epoch: int, batch_size: int | None, drop_last: bool,
                   stages: list[Stage] | None = None) -> ReaderPass:
        world = self.world()
        sp = self.plan(epoch)
        span = resume_span([sp.sequences], stages or [], world, seed=self.seed, epoch=epoch, shuffle=False,
                           batch_size=batch_size, drop_last=drop_last)
        reads = [Read(self.units_[r.unit], SampleSlice(r.start, r.stop, int(self._tokens[r.unit])))
                 for r in token_reads(sp, span.segments)]
        return ReaderPass(world, epoch, reads, span)

    def fetch_segment(self, unit: TokenUnit, start: int, stop: int, count: int) -> FetchItem:
        """A ``.bin``: the byte range of the raw tokens that ``[start, stop)`` needs; a row group:
        its token column chunk."""
        if unit.index >= 0:
            meta = self._meta(unit.url)
            leaves = [self._leaf(meta, unit.url)]
            ranges = fmt.column_chunk_ranges(meta, unit.index, leaves, unit.size, unit.url)
            return FetchItem(unit.url, unit.size, tuple(ranges), self.etag(unit.url))
        if self.layout == "tar":  # the bytes of the samples that hold [start, stop)
            offsets = self._offsets[unit.url]
            d0, d1 = self._samples(unit, start, stop)
            return FetchItem(unit.url, unit.size, ((int(offsets[d0]), int(offsets[d1])),),
                             self.etag(unit.url))
        assert self.dtype is not None
        a, b = self._raw(unit, start, stop)
        return FetchItem(unit.url, unit.size, ((a * self.dtype.itemsize, b * self.dtype.itemsize),),
                         self.etag(unit.url))

    def _raw(self, unit: TokenUnit, start: int, stop: int) -> tuple[int, int]:
        """The raw tokens fetched for ``[start, stop)``: at least one (a range is never empty)."""
        lengths = self._doc_lengths(unit)
        a, b = raw_range(lengths, start, stop, self.bos_id is not None, self.eos_id is not None)
        if b == a:
            a = min(a, unit.tokens - 1)
            b = a + 1
        return a, b

    def _samples(self, unit: TokenUnit, start: int, stop: int) -> tuple[int, int]:
        """A tar shard's samples (documents) ``[d0, d1)`` that stream positions ``[start, stop)``
        need: at least one."""
        lengths = self._doc_lengths(unit)
        starts = np.concatenate([[0], np.cumsum(lengths + self.specials)])
        d0 = max(int(np.searchsorted(starts, start, side="right")) - 1, 0)
        d1 = min(max(int(np.searchsorted(starts, stop, side="left")), d0 + 1), len(lengths))
        return d0, d1

    def _doc_lengths(self, unit: TokenUnit) -> np.ndarray:
        lengths = self._lengths[unit.i]
        assert lengths is not None  # (a .bin's documents are known before reading)
        return lengths

    def read_tokens(self, unit: TokenUnit, start: int, stop: int, reader: ItemReader
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Stream positions ``[start, stop)`` of ``unit``: tokens and global document numbers."""
        if unit.index >= 0:
            values, lengths = self._row_group_tokens(unit, reader)
            tokens, doc = augmented(lengths, start, stop, values, 0, self.bos_id, self.eos_id)
        elif self.layout == "tar":
            assert self.field is not None
            lengths = self._doc_lengths(unit)
            d0, d1 = self._samples(unit, start, stop)
            raw = tar_tokens(reader.read_ranges()[0], reader.url, self.field, lengths[d0:d1])
            tokens, doc = augmented(lengths, start, stop, raw, int(lengths[:d0].sum()), self.bos_id,
                                    self.eos_id)
        else:
            assert self.dtype is not None
            lengths = self._doc_lengths(unit)
            a, b = self._raw(unit, start, stop)
            raw = tokens_of(reader.read_ranges()[0], self.dtype, reader.url, b - a)
            tokens, doc = augmented(lengths, start, stop, raw, a, self.bos_id, self.eos_id)
            if self.sep_id is not None and self.documents:  # a document ends after each separator
                ends = np.concatenate([[0], np.cumsum(tokens[:-1] == self.sep_id)])
                return tokens, (np.int64(unit.i) << 32) + ends  # distinct from other units' keys
        return tokens, doc + unit.first_doc

    def _row_group_tokens(self, unit: TokenUnit, reader: ItemReader) -> tuple[np.ndarray, np.ndarray]:
        """A row group's token values and each row's length, checked against its footer's count."""
        parts = zip([s for s, _ in reader.item.ranges or ()], reader.read_ranges(), strict=True)
        assert self.column is not None
        table = fmt.read_row_group(self._meta(unit.url), parts, unit.size, unit.index, [self.column],
                                   unit.url)
        column = table.column(0).combine_chunks()
        if column.null_count:
            column = column.fill_null([])  # a null row: an empty document
        values = column.flatten()
        if values.null_count:
            raise FormatError(f"{redact_url(unit.url)}: row group {unit.index} of column {self.column!r} "
                              "holds null token ids", url=unit.url, key=f"row group {unit.index}")
        if len(values) != unit.tokens or len(column) != unit.docs:
            raise FormatError(
                f"{redact_url(unit.url)}: row group {unit.index} holds {len(values)} tokens in {len(column)} "
                f"rows where its footer says {unit.tokens} in {unit.docs} (the file changed after it was "
                "listed, or was written without column statistics and holds empty lists: write it with "
                "statistics)", url=unit.url, key=f"row group {unit.index}")
        offsets = column.offsets.to_numpy()
        return values.to_numpy(zero_copy_only=False), np.diff(offsets).astype(np.int64)

    def read_unit(self, unit: TokenUnit, reader: ItemReader) -> Iterator[Any]:
        yield self.read_tokens(unit, 0, int(self._tokens[unit.i]), reader)

    # ---- the pass ---------------------------------------------------------------------------

    def iter_batches(self, batch_size: int | None, *, drop_last: bool = False, collate_fn: Any = None,
                     in_flight: int | None = None) -> EpochIterator:
        """This reader's sequences, packed and batched by ``batch_size`` with the plan's sizes."""
        install()  # FORK-RESET from the first pass on
        p = self.reader_pass(batch_size, drop_last)
        self._note_plan(p)
        sp = self.plan(p.epoch)
        live = self._live
        start = live is not None and not live.before and not live.samples_before  # (not a resumed pass)
        if sp.dropped and p.world.slot == 0 and start:
            self._counters.add("tokens.dropped", sp.dropped)  # once per epoch, by the first reader
        flushes = [r.flush for r in token_reads(sp, p.span.segments)] if p.span is not None else []
        items = [self.fetch_segment(read.unit, *read.part) for read in p.reads]  # type: ignore[misc]
        fetcher = self._fetcher(items, p)

        def chunks() -> Iterator[tuple[np.ndarray, np.ndarray | None, bool]]:
            for read, reader, flush in zip(p.reads, fetcher.readers(0, len(items)), flushes, strict=True):
                assert isinstance(read.part, SampleSlice)
                tokens, docs = self.read_tokens(read.unit, read.part.start, read.part.stop, reader)
                yield tokens, docs, flush

        lengths = None
        if sp.bounds is not None and p.span is not None:  # packing "fit": each sequence's own length
            lengths = [int(n) for s in p.span.segments for n in sp.lengths(s.start, s.stop)]
        seqs: Iterator[Any] = pack(chunks(), self.width, pad_id=self.pad_id, documents=self.documents,
                                   padded=lambda n: self._counters.add("tokens.padded", n), lengths=lengths)
        if self.map is not None:
            seqs = map(self.map, seqs)
        if self._live is not None:
            seqs = self._live.count(seqs)  # sequences delivered: the position (state_dict)
        if batch_size is not None:
            seqs = batches(seqs, batch_size, collate_fn=collate_fn, drop_last=drop_last, in_flight=in_flight,
                           sizes=p.batch_sizes(batch_size))
        return EpochIterator(seqs, fetcher.close, batched=batch_size is not None)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_meta_cache"] = {}  # parsed again, lazily, in the process that reads
        return state

    def __repr__(self) -> str:
        return (f"TokenDataset({len(self.units_)} units, e.g. {redact_url(self.units_[0].url)!r}, "
                f"{self.num_tokens} tokens, seq_len={self.seq_len}, batch_size={self.batch_size})")


def _size(shard: Shard) -> int:
    if shard.size is None:
        raise SpecError(f"{redact_url(shard.url)}: size unknown")
    return shard.size

