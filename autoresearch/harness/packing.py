"""BOS-aligned best-fit packing of documents into rows (numpy only: ar's feed packs in a process without torch).

Every row holds T+1 tokens and starts at a document start (each stored document begins with BOS). Rows are
filled best-fit from a buffer of documents: take the largest document that fits the space left; only when none
fits, crop the shortest one to fill the row exactly (its tail is dropped). No padding, ever.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator

import numpy as np

BUFFER_DOCS = 1000  # documents the best-fit search chooses from (upstream nanochat's value)


class BestFitPacker:
    """Packs documents, in the order `stream` yields them, into rows of `row_len` tokens.

    `stream` yields (doc_ids, epoch) chunks; `lengths[doc_id]` is a document's length in tokens. The buffer keeps
    documents sorted by length, so "the largest that fits" is one bisect."""

    def __init__(self, lengths: np.ndarray, row_len: int, stream: Iterator[tuple[np.ndarray, int]],
                 buffer_size: int = BUFFER_DOCS):
        assert row_len > 0 and buffer_size > 0
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.row_len = row_len
        self.buffer_size = buffer_size
        self.epoch = 1
        self._stream = stream
        self._pending: Iterator[int] = iter(())
        self._exhausted = False
        self._lens: list[int] = []   # sorted ascending
        self._ids: list[int] = []    # aligned with _lens

    def _refill(self) -> None:
        lens, ids = self._lens, self._ids
        while len(lens) < self.buffer_size and not self._exhausted:
            doc = next(self._pending, None)
            if doc is None:
                try:
                    chunk, self.epoch = next(self._stream)
                except StopIteration:
                    self._exhausted = True
                    return
                self._pending = iter(chunk.tolist())
                continue
            n = int(self.lengths[doc])
            i = bisect_right(lens, n)
            lens.insert(i, n)
            ids.insert(i, doc)

    def fill_row(self, docs: list[int], takes: list[int]) -> bool:
        """Append one row's (document, tokens taken from its start) segments; False if the stream ran out first
        (the partial row is dropped from `docs`/`takes`)."""
        remaining, mark = self.row_len, len(docs)
        lens, ids = self._lens, self._ids
        while remaining:
            self._refill()
            if not lens:
                del docs[mark:], takes[mark:]
                return False
            i = bisect_right(lens, remaining) - 1
            if i >= 0:                # the largest document that fits; the oldest of that length, so that
                i = bisect_left(lens, lens[i], 0, i)  # documents leave in stream order among equals
                take = lens.pop(i)
                doc = ids.pop(i)
            else:                     # nothing fits: crop the shortest, which wastes the least
                lens.pop(0)
                doc = ids.pop(0)
                take = remaining
            docs.append(doc)
            takes.append(take)
            remaining -= take
        return True


def doc_stream(n: int, seed: int, shuffle: bool) -> Iterator[tuple[np.ndarray, int]]:
    """Documents 0..n-1, epoch after epoch: shuffled per epoch with (seed, epoch) when `shuffle`."""
    epoch = 1
    while True:
        yield (np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)), epoch
        epoch += 1


def pack_rows(doc_lengths: np.ndarray, row_len: int, *, buffer_size: int = BUFFER_DOCS) -> list[list[tuple[int, int]]]:
    """Best-fit pack documents 0..n-1 (in that order) into rows of `row_len`; each row is a list of
    (document index, tokens taken from the document's start). The last, incomplete row is dropped."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    packer = BestFitPacker(lengths, row_len, iter([(np.arange(len(lengths)), 1)]), buffer_size)
    rows = []
    while True:
        docs: list[int] = []
        takes: list[int] = []
        if not packer.fill_row(docs, takes):
            return rows
        rows.append(list(zip(docs, takes)))


def gather_rows(tokens: np.ndarray, offsets: np.ndarray, docs: np.ndarray, takes: np.ndarray, row_len: int) -> np.ndarray:
    """The token rows for a packing plan: one fancy index into `tokens` for the whole batch."""
    takes = np.asarray(takes, dtype=np.int64)
    out_start = np.cumsum(takes) - takes
    shift = np.repeat(offsets[docs] - out_start, takes)
    pos = np.arange(shift.size, dtype=np.int64)
    pos += shift
    return tokens[pos].reshape(-1, row_len)
