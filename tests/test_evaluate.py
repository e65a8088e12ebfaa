import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autoresearch.harness.evaluate import RECORD_KEYS, evaluate_bpb, read_record

T = 7  # rows of 8 tokens: two 4-token documents each


class FixedLogits(torch.nn.Module):
    """Predicts the same distribution at every position, whatever the input."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.tensor(logits, dtype=torch.float32))

    def forward(self, x, targets=None, reduction="mean"):
        logits = self.logits.expand(x.numel(), -1)
        return F.cross_entropy(logits, targets.reshape(-1), reduction=reduction).view(x.shape)


class Bigram(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, vocab)

    def forward(self, x, targets=None, reduction="mean"):
        return F.cross_entropy(self.emb(x).flatten(0, 1), targets.reshape(-1), reduction=reduction).view(x.shape)


def handmade(tmp_path, docs, token_bytes):
    """A tokenized folder written by hand: val documents [BOS=0, ...] and a byte-length table."""
    tok = tmp_path / "hand" / "tok-4"
    tok.mkdir(parents=True)
    counts = {}
    for split in ("train", "val"):
        flat = np.concatenate(docs).astype(np.uint16)
        flat.tofile(tok / f"{split}.bin")
        np.save(tok / f"{split}.idx.npy", np.concatenate(([0], np.cumsum([len(d) for d in docs]))).astype(np.int64))
        counts[split] = {"docs": len(docs), "tokens": int(flat.size)}
    np.save(tok / "token_bytes.npy", np.array(token_bytes, dtype=np.int32))
    (tok / "tokenizer.json").write_text("{}")
    (tok / "meta.json").write_text(json.dumps({"format": 1, "bos_id": 0, **counts}))
    return tok


def test_bpb_against_a_hand_computed_value(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.concatenate(([0], rng.integers(1, 4, size=3))) for _ in range(24)]  # 24 docs -> 12 rows
    tok = handmade(tmp_path, docs, [0, 1, 2, 3])
    logits = [0.5, 1.0, -1.0, 2.0]
    logp = np.array(logits) - np.log(np.exp(logits).sum())
    # 12 rows of 7 targets: every non-BOS token of every document is a target exactly once
    body = np.concatenate([d[1:] for d in docs])
    want = -logp[body].sum() / (math.log(2) * np.array([0, 1, 2, 3])[body].sum())
    record = tmp_path / "out" / "record.json"
    got = evaluate_bpb(FixedLogits(logits), tok, eval_tokens=12 * T, batch_size=3, seq_len=T, record_path=record,
                       dataset="hand")
    assert got == pytest.approx(want, rel=1e-6)
    rec = read_record(record)
    assert set(rec) == set(RECORD_KEYS)
    assert rec["val_bpb"] == got and rec["eval_tokens"] == 12 * T and rec["seq_len"] == T
    assert rec["eval_bytes"] == int(np.array([0, 1, 2, 3])[body].sum()) and rec["dataset"] == "hand"
    assert [p.name for p in record.parent.iterdir()] == ["record.json"]  # no temp file left


def test_exactly_eval_tokens_when_not_a_multiple_of_the_batch(tmp_path):
    docs = [np.array([0, 1, 2, 3])] * 40
    tok = handmade(tmp_path, docs, [0, 2, 2, 2])
    record = tmp_path / "r.json"
    # per row the targets are [t t t BOS t t t]; 20 targets = 2 rows + 6 -> 6 + 6 + 5 = 17 counted
    got = evaluate_bpb(FixedLogits([0.0] * 4), tok, eval_tokens=20, batch_size=2, seq_len=T, record_path=record)
    assert got == pytest.approx(math.log(4) / (2 * math.log(2)))
    rec = read_record(record)
    assert rec["eval_tokens"] == 20 and rec["eval_bytes"] == 2 * 17 and rec["dataset"] == "hand"


def test_warns_when_the_split_is_shorter_than_eval_tokens(tmp_path):
    tok = handmade(tmp_path, [np.array([0, 1, 2, 3])] * 4, [0, 1, 1, 1])
    with pytest.warns(UserWarning, match="read more than once"):
        evaluate_bpb(FixedLogits([0.0] * 4), tok, eval_tokens=10 * T, batch_size=2, seq_len=T)


def test_real_model_on_the_tiny_dataset(tiny_dataset, tmp_path):
    model = Bigram(tiny_dataset.vocab_size)
    model.train()
    kw = dict(eval_tokens=3000, batch_size=4, seq_len=64)
    a = evaluate_bpb(model, tiny_dataset.tok_dir, record_path=tmp_path / "rec.json", **kw)
    b = evaluate_bpb(model, tiny_dataset.tok_dir, **kw)
    assert a == b and math.isfinite(a) and a > 0
    assert model.training  # mode restored
    assert read_record(tmp_path / "rec.json")["dataset"] == tiny_dataset.name
    assert all(p.grad is None for p in model.parameters())


def test_bad_eval_tokens(tiny_dataset):
    with pytest.raises(ValueError, match="eval_tokens"):
        evaluate_bpb(Bigram(8), tiny_dataset.tok_dir, eval_tokens=0, batch_size=1, seq_len=8)
