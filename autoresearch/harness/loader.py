"""The training and validation dataloader: BOS-aligned best-fit packed rows (packing.py), x = row[:-1], y = row[1:].

The packing decisions are a few Python list operations per document (a sorted buffer and bisect); the tokens
are gathered with one vectorised index per batch from the memory-mapped corpus. All of it runs in a background
thread that keeps `prefetch` ready batches (pinned when the target is CUDA), so the training loop only pays a
non-blocking host-to-device copy.

Under ar the training split is not readable by the run: a "train" loader then takes its rows from ar's feed
(feed.py; AR_DATA_FD), packed by ar with the same packer and seed, and the run's training window opens with the
first batch it asks for. It asks for none before its first `next()`; when the window closes, `next()` raises
`WindowClosed` (a StopIteration: a `for` loop over the loader simply ends).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .data import check_tok_dir
from .feed import FeedClient, WindowClosed
from .packing import BUFFER_DOCS, BestFitPacker, doc_stream, gather_rows, pack_rows

__all__ = ["PackedLoader", "WindowClosed", "BestFitPacker", "pack_rows", "gather_rows", "doc_stream"]
_CLOSED = object()      # the producer's word that the feed's window has closed

class PackedLoader:
    """Infinite iterator of (x, y) int64 tensors [B, T] on `device`.

    Documents are shuffled per epoch with (`seed`, epoch) when `shuffle`; `epoch` is the pass over the split's
    documents that the last returned batch reached (it starts at 1; it counts documents taken into the
    best-fit buffer, so it runs ahead by up to BUFFER_DOCS documents). Deterministic for a given seed,
    whatever `threads` is; from ar's feed (`served`: its socket) the same rows as from the files. Call `close()` (or use it as a context manager) to stop the background thread."""

    def __init__(self, tok_dir: Path, split: str, batch_size: int, seq_len: int, *, device="cpu", seed: int = 0,
                 shuffle: bool = True, prefetch: int = 4, threads: int | None = None, served: int | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch size and sequence length must be positive (got {batch_size}, {seq_len})")
        tok_dir = Path(tok_dir)
        if served is None and split == "train" and os.environ.get("AR_DATA_FD"):
            served = int(os.environ["AR_DATA_FD"])          # under ar: the feed, never the files
        self.batch_size, self.seq_len, self.row_len = batch_size, seq_len, seq_len + 1
        self.device = torch.device(device)
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 1
        self._pin = self.device.type == "cuda"
        self._threads = max(1, threads or 1)
        self._feed = FeedClient(served) if served is not None else None
        if self._feed is None:
            check_tok_dir(tok_dir, (split,))
            self.tokens = np.memmap(tok_dir / f"{split}.bin", dtype=np.uint16, mode="r")
            self.offsets = np.load(tok_dir / f"{split}.idx.npy")
            self.lengths = np.diff(self.offsets)
            self._packer = BestFitPacker(self.lengths, self.row_len, doc_stream(len(self.lengths), seed, shuffle),
                                         buffer_size=min(BUFFER_DOCS, len(self.lengths)))
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))
        self._closed_window = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"PackedLoader-{split}", daemon=True)
        if self._feed is None:
            self._thread.start()        # from the feed: not before the first next() (that opens the window)

    @property
    def deadline(self) -> float | None:
        """Wall-clock end of ar's training window (known from the first batch), or None (no feed)."""
        return self._feed.deadline if self._feed is not None else None

    @property
    def window_start(self) -> float | None:
        """Wall-clock opening of ar's training window (known from the first batch), or None (no feed)."""
        return self._feed.window_start if self._feed is not None else None

    def _plan(self) -> tuple[np.ndarray, np.ndarray, int]:
        docs: list[int] = []
        takes: list[int] = []
        for _ in range(self.batch_size):
            self._packer.fill_row(docs, takes)  # the stream is endless: always True
        return np.array(docs, dtype=np.int64), np.array(takes, dtype=np.int64), self._packer.epoch

    def _assemble(self, plan: tuple[np.ndarray, np.ndarray, int]) -> tuple[torch.Tensor, int]:
        docs, takes, epoch = plan
        rows = gather_rows(self.tokens, self.offsets, docs, takes, self.row_len)
        return self._split(rows, epoch)

    def _split(self, rows: np.ndarray, epoch: int) -> tuple[torch.Tensor, int]:
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
                if self._feed is not None:
                    got = self._feed.fetch(self.batch_size, self.row_len)
                    if not self._put(self._split(*got) if got is not None else _CLOSED):
                        return
                    if got is None:
                        return
                    continue
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
        if self._closed_window:
            raise WindowClosed("ar's training window is over")
        if not self._thread.is_alive() and not self._thread.ident:
            self._thread.start()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise RuntimeError("the data loader's thread has stopped") from None
        if item is _CLOSED:
            self._closed_window = True
            raise WindowClosed("ar's training window is over")
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
        if self._feed is not None:
            self._feed.close()

    def __enter__(self) -> "PackedLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
