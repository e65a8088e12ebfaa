import numpy as np
import pytest
import torch

from autoresearch.errors import DataError
from autoresearch.harness.data import load_meta
from autoresearch.harness.loader import BestFitPacker, PackedLoader, gather_rows, pack_rows


def check_best_fit(lengths, rows, row_len):
    """Replay `rows` against the rule with every document visible (buffer >= number of documents): each
    whole document is the largest unused one that fits; a crop happens only when no unused document fits,
    takes the shortest and fills the row exactly."""
    unused = list(range(len(lengths)))
    for row in rows:
        assert sum(take for _, take in row) == row_len  # full row: no padding
        remaining = row_len
        for doc, take in row:
            fits = [lengths[d] for d in unused if lengths[d] <= remaining]
            if take == lengths[doc]:
                assert lengths[doc] == max(fits)
            else:
                assert not fits and take == remaining and lengths[doc] == min(lengths[d] for d in unused)
            unused.remove(doc)
            remaining -= take


@pytest.mark.parametrize("seed", range(5))
def test_pack_rows_best_fit(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 80, size=300)
    lengths[::17] = rng.integers(100, 300, size=lengths[::17].size)  # some longer than a row
    rows = pack_rows(lengths, 64, buffer_size=1000)
    assert len(rows) > 100
    check_best_fit(lengths, rows, 64)


def test_pack_rows_examples():
    # 5 fits whole next to 3; the 9 must be cropped to fill a row by itself
    assert pack_rows(np.array([3, 5, 9]), 8) == [[(1, 5), (0, 3)], [(2, 8)]]
    # nothing fits the last 2 slots: the shortest remaining (4) is cropped, not a 6; equals leave in order
    assert pack_rows(np.array([6, 6, 4, 6]), 8, buffer_size=10) == [[(0, 6), (2, 2)], [(1, 6), (3, 2)]]
    assert pack_rows(np.array([3]), 8) == []  # an incomplete last row is dropped


def test_packer_keeps_epochs_going():
    lengths = np.array([5, 5, 5])
    chunks = iter([(np.arange(3), 1), (np.arange(3), 2), (np.arange(3), 3)])
    packer = BestFitPacker(lengths, 10, chunks, buffer_size=3)
    docs, takes = [], []
    for _ in range(4):
        assert packer.fill_row(docs, takes)
    assert packer.epoch == 3 and sum(takes) == 40


def test_gather_rows_matches_a_plain_loop():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=200)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = rng.integers(0, 60000, size=offsets[-1]).astype(np.uint16)
    rows = pack_rows(lengths, 33)
    docs = np.array([d for r in rows for d, _ in r])
    takes = np.array([t for r in rows for _, t in r])
    want = np.array([np.concatenate([tokens[offsets[d]:offsets[d] + t] for d, t in r]) for r in rows])
    assert (gather_rows(tokens, offsets, docs, takes, 33) == want).all()


def batches(loader, n):
    out = [tuple(t.clone() for t in next(loader)) for _ in range(n)]
    loader.close()
    return out


def test_loader_rows(tiny_dataset):
    bos = load_meta(tiny_dataset.tok_dir)["bos_id"]
    tokens = np.fromfile(tiny_dataset.tok_dir / "train.bin", dtype=np.uint16)
    idx = np.load(tiny_dataset.tok_dir / "train.idx.npy")
    starts = {tuple(tokens[s:s + 8]) for s in idx[:-1]}
    with PackedLoader(tiny_dataset.tok_dir, "train", 8, 64, seed=1) as loader:
        for _ in range(20):
            x, y = next(loader)
            assert x.shape == y.shape == (8, 64) and x.dtype == y.dtype == torch.int64
            assert x.is_contiguous() and y.is_contiguous()
            assert (x[:, 0] == bos).all()                     # every row starts with BOS ...
            assert all(tuple(r[:8].tolist()) in starts for r in x)  # ... at a real document start
            assert (x[:, 1:] == y[:, :-1]).all()
            assert int(x.max()) < tiny_dataset.vocab_size


def test_loader_deterministic(tiny_dataset):
    a = batches(PackedLoader(tiny_dataset.tok_dir, "train", 4, 32, seed=3), 10)
    b = batches(PackedLoader(tiny_dataset.tok_dir, "train", 4, 32, seed=3, threads=3, prefetch=1), 10)
    c = batches(PackedLoader(tiny_dataset.tok_dir, "train", 4, 32, seed=4), 10)
    assert all((x1 == x2).all() and (y1 == y2).all() for (x1, y1), (x2, y2) in zip(a, b))
    assert any((x1 != x2).any() for (x1, _), (x2, _) in zip(a, c))


def test_loader_epochs_and_unshuffled(tiny_dataset):
    ndocs = load_meta(tiny_dataset.tok_dir)["val"]["docs"]
    first = batches(PackedLoader(tiny_dataset.tok_dir, "val", 4, 64, shuffle=False), 5)
    again = batches(PackedLoader(tiny_dataset.tok_dir, "val", 4, 64, shuffle=False, seed=99), 5)
    assert all((a[0] == b[0]).all() for a, b in zip(first, again))  # no shuffle: the seed does not matter
    loader = PackedLoader(tiny_dataset.tok_dir, "val", 4, 64, shuffle=False)
    assert loader.epoch == 1
    seen = []
    for _ in range(3 * ndocs // 4 + 1):  # each row takes at least one document
        next(loader)
        seen.append(loader.epoch)
    loader.close()
    assert seen == sorted(seen) and seen[-1] >= 3


def test_loader_bad_input(tiny_dataset, tmp_path):
    with pytest.raises(ValueError, match="split"):
        PackedLoader(tiny_dataset.tok_dir, "test", 2, 8)
    with pytest.raises(DataError, match="not a prepared dataset"):
        PackedLoader(tmp_path / "tok-512", "train", 2, 8)


def test_loader_close_stops_the_thread(tiny_dataset):
    loader = PackedLoader(tiny_dataset.tok_dir, "train", 2, 16, prefetch=1)
    next(loader)
    loader.close()
    assert not loader._thread.is_alive()
