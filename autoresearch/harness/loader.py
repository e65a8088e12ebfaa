"""BOS-aligned best-fit packing dataloader.

Every row holds T+1 tokens and starts at a document start (each stored document begins with BOS). Rows are
filled best-fit from a buffer of documents: take the largest document that fits the space left; only when none
fits, crop the shortest one to fill the row exactly (its tail is dropped). No padding, ever. x = row[:-1],
y = row[1:].

The packing decisions are a few Python list operations per document (a sorted buffer and bisect); the tokens
are gathered with one vectorised index per batch from the memory-mapped corpus. All of it runs in a background
thread that keeps `prefetch` ready batches (pinned when the target is CUDA), so the training loop only pays a
non-blocking host-to-device copy.
"""

from __future__ import annotations

import queue
import threading
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .data import check_tok_dir

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


class PackedLoader:
    """Infinite iterator of (x, y) int64 tensors [B, T] on `device`.

    Documents are shuffled per epoch with (`seed`, epoch) when `shuffle`; `epoch` is the pass over the split's
    documents that the last returned batch reached (it starts at 1; it counts documents taken into the
    best-fit buffer, so it runs ahead by up to BUFFER_DOCS documents). Deterministic for a given seed,
    whatever `threads` is. Call `close()` (or use it as a context manager) to stop the background thread."""

    def __init__(self, tok_dir: Path, split: str, batch_size: int, seq_len: int, *, device="cpu", seed: int = 0,
                 shuffle: bool = True, prefetch: int = 4, threads: int | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch size and sequence length must be positive (got {batch_size}, {seq_len})")
        tok_dir = Path(tok_dir)
        check_tok_dir(tok_dir, (split,))
        self.tokens = np.memmap(tok_dir / f"{split}.bin", dtype=np.uint16, mode="r")
        self.offsets = np.load(tok_dir / f"{split}.idx.npy")
        self.lengths = np.diff(self.offsets)
        self.batch_size, self.seq_len, self.row_len = batch_size, seq_len, seq_len + 1
        self.device = torch.device(device)
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 1
        self._pin = self.device.type == "cuda"
        self._threads = max(1, threads or 1)
        self._packer = BestFitPacker(self.lengths, self.row_len, self._doc_stream(),
                                     buffer_size=min(BUFFER_DOCS, len(self.lengths)))
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"PackedLoader-{split}", daemon=True)
        self._thread.start()

    def _doc_stream(self) -> Iterator[tuple[np.ndarray, int]]:
        n, epoch = len(self.lengths), 1
        while True:
            if self.shuffle:
                yield np.random.default_rng([self.seed, epoch]).permutation(n), epoch
            else:
                yield np.arange(n), epoch
            epoch += 1

    def _plan(self) -> tuple[np.ndarray, np.ndarray, int]:
        docs: list[int] = []
        takes: list[int] = []
        for _ in range(self.batch_size):
            self._packer.fill_row(docs, takes)  # the stream is endless: always True
        return np.array(docs, dtype=np.int64), np.array(takes, dtype=np.int64), self._packer.epoch

    def _assemble(self, plan: tuple[np.ndarray, np.ndarray, int]) -> tuple[torch.Tensor, int]:
        docs, takes, epoch = plan
        rows = gather_rows(self.tokens, self.offsets, docs, takes, self.row_len)
        B, T = self.batch_size, self.seq_len
        # x and y side by side in one buffer: one host-to-device copy per batch, both contiguous on arrival
        buf = torch.empty((2, B, T), dtype=torch.int64, pin_memory=self._pin)
        view = buf.numpy()
        view[0] = rows[:, :-1]
        view[1] = rows[:, 1:]
        return buf, epoch

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self) -> None:
        pool = ThreadPoolExecutor(self._threads) if self._threads > 1 else None
        pending: deque = deque()
        try:
            while not self._stop.is_set():
                if pool is None:
                    if not self._put(self._assemble(self._plan())):
                        return
                    continue
                pending.append(pool.submit(self._assemble, self._plan()))  # order kept: results taken FIFO
                if len(pending) >= self._threads and not self._put(pending.popleft().result()):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)
        finally:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def __iter__(self) -> "PackedLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data loader's thread has stopped") from None
        if isinstance(item, BaseException):
            raise item
        buf, self.epoch = item
        if self.device.type != "cpu":
            buf = buf.to(self.device, non_blocking=True)
        return buf[0], buf[1]

    def close(self) -> None:
        if not hasattr(self, "_stop"):
            return
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
