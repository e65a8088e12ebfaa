"""The training feed: under ar, the training split reaches a run only through ar, and ar's clock opens the run's
training window with the first batch it serves.

    Feed (trusted, in ar's process)  ── a socket the run inherits (AR_DATA_FD) ──  FeedClient (in train.py's)

`Feed` holds the memory-mapped training split outside the sandbox (the run cannot open train.bin: its data view
has only meta.json and tokenizer.json), packs rows with the same best-fit packer and seed as a PackedLoader over
the files would, and answers one request at a time. The first request opens the window: its deadline is that
moment + the budget − a penalty `on_open()` returns (start-up beyond what the baseline's allows: see
experiment/clock.py). From the deadline on it serves nothing. So nothing trains on real data before the clock,
every run gets the same window whatever its start-up took, and compute moved before the window can use only
what else the run can read.

A run that started beside another's window (experiment/headstart.py) has its first request held until
`before_open()` says the GPU is its own; the window opens after that wait. The window of the run beside it is
lengthened by what `extension()` says that start-up has used of the GPU so far (read every `EXTENSION_EVERY`
seconds, never shortened, at most `extension_cap`): what it lost to its neighbour, it gets back at its end.

Wire format (little-endian): request `<II` rows, row_len; reply `<BddIQ` status (0 rows, 1 the window has
closed), deadline (wall clock), window start (wall clock), epoch, token count, then that many uint16 ids, rows
× row_len, each row BOS-aligned as PackedLoader makes them.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .data import check_tok_dir
from .packing import BUFFER_DOCS, BestFitPacker, doc_stream, gather_rows

REQUEST = struct.Struct("<II")
REPLY = struct.Struct("<BddIQ")
ROWS, CLOSED = 0, 1
MAX_TOKENS = 1 << 25            # one reply at most 64 MiB: a request beyond it is a broken client
EXTENSION_EVERY = 0.25          # seconds between reads of `extension()` (a driver read, off the data path)


class Feed:
    """Serve training rows to one run over a socket pair; `child_fd` is the end the run inherits. `clock`: where
    the window's times are read (anything with time(); tests pass one they move)."""

    def __init__(self, tok_dir: Path, *, seed: int, budget: float,
                 on_open: Callable[[], float] | None = None, before_open: Callable[[], bool] | None = None,
                 extension: Callable[[], float] | None = None, extension_cap: float = 0.0, clock=time):
        tok_dir = Path(tok_dir)
        check_tok_dir(tok_dir, ("train",))
        self.tokens = np.memmap(tok_dir / "train.bin", dtype=np.uint16, mode="r")
        self.offsets = np.load(tok_dir / "train.idx.npy")
        self.seed, self.budget, self.on_open, self.clock = seed, float(budget), on_open, clock
        self.before_open = before_open             # blocks until the window may open; False: it never will
        self.extension, self.extension_cap = extension, float(extension_cap)
        self.extended = 0.0                        # seconds added to the window (a neighbour's head start)
        self._extension_read = -1e18
        self.opened_at: float | None = None       # wall clock: the first batch was asked for
        self.deadline: float | None = None
        self.penalty = 0.0                         # seconds taken off the window (on_open's answer)
        self.last_served: float | None = None
        self.batches = self.tokens_served = self.refused = 0
        self._packers: dict[int, object] = {}
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.child_fd = child.detach()
        os.set_inheritable(self.child_fd, True)
        self._thread = threading.Thread(target=self._serve, name="ar-feed", daemon=True)
        self._thread.start()

    def close_child_end(self) -> None:
        """Once the run has inherited it: ar keeps only its own end."""
        if self.child_fd is not None:
            try:
                os.close(self.child_fd)
            except OSError:
                pass
            self.child_fd = None

    def close(self) -> None:
        self.close_child_end()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._sock.close()

    def _rows(self, rows: int, row_len: int) -> tuple[np.ndarray, int]:
        packer = self._packers.get(row_len)
        if packer is None:
            lengths = np.diff(self.offsets)
            packer = self._packers[row_len] = BestFitPacker(
                lengths, row_len, doc_stream(len(lengths), self.seed, True),
                buffer_size=min(BUFFER_DOCS, len(lengths)))
        docs: list[int] = []
        takes: list[int] = []
        for _ in range(rows):
            packer.fill_row(docs, takes)
        out = gather_rows(self.tokens, self.offsets, np.array(docs, dtype=np.int64),
                          np.array(takes, dtype=np.int64), row_len)
        return out, packer.epoch

    def _serve(self) -> None:
        try:
            while True:
                req = _recv_exact(self._sock, REQUEST.size)
                if req is None:
                    return
                rows, row_len = REQUEST.unpack(req)
                if rows < 1 or row_len < 2 or rows * row_len > MAX_TOKENS:
                    self._sock.shutdown(socket.SHUT_RDWR)   # a broken request: the run's read sees the end now
                    return
                if self.opened_at is None and self.before_open is not None and not self.before_open():
                    self._sock.shutdown(socket.SHUT_RDWR)   # the session is stopping: no window for this run
                    return
                now = self.clock.time()
                if self.opened_at is None:
                    self.penalty = max(0.0, float(self.on_open() if self.on_open else 0.0))
                    self.opened_at, self.deadline = now, now + self.budget - self.penalty
                if self.extension is not None and now - self._extension_read >= EXTENSION_EVERY:
                    self._extension_read = now
                    more = min(self.extension_cap, max(self.extended, float(self.extension())))
                    self.deadline += more - self.extended
                    self.extended = more
                if now >= self.deadline:
                    self.refused += 1
                    self._sock.sendall(REPLY.pack(CLOSED, self.deadline, self.opened_at, 0, 0))
                    continue
                block, epoch = self._rows(rows, row_len)
                data = np.ascontiguousarray(block, dtype="<u2").tobytes()
                self._sock.sendall(REPLY.pack(ROWS, self.deadline, self.opened_at, epoch, block.size) + data)
                self.batches += 1
                self.tokens_served += block.size
                self.last_served = self.clock.time()
        except OSError:
            return                                  # the run is gone


def _recv_exact(sock, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class WindowClosed(StopIteration):
    """The run's training window is over: ar serves no more training data."""


class FeedClient:
    """The run's end of the feed (used by PackedLoader): rows as ar serves them."""

    def __init__(self, fd: int):
        self._sock = socket.socket(fileno=fd)
        self.deadline: float | None = None       # known from the first reply
        self.window_start: float | None = None

    def fetch(self, rows: int, row_len: int) -> tuple[np.ndarray, int] | None:
        """(rows × row_len uint16 ids, epoch), or None once the window has closed (or ar is gone)."""
        try:
            self._sock.sendall(REQUEST.pack(rows, row_len))
            head = _recv_exact(self._sock, REPLY.size)
        except OSError:
            return None
        if head is None:
            return None
        status, self.deadline, self.window_start, epoch, n = REPLY.unpack(head)
        if status != ROWS:
            return None
        body = _recv_exact(self._sock, 2 * n)
        if body is None:
            return None
        return np.frombuffer(body, dtype="<u2").reshape(rows, row_len), epoch

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
