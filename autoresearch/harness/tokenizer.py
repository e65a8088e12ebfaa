"""Byte-level BPE (Hugging Face `tokenizers`) with one special token, `<|bos|>`, and the token -> byte-length
table that bits-per-byte needs.

The split pattern is GPT-4's (as nanochat uses it), with digits grouped by at most two. BOS is not added by
`encode`: the corpus writer and the loader place it, so that a document is exactly `[BOS] + encode(text)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

BOS = "<|bos|>"
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
MIN_VOCAB = 257        # 256 bytes + BOS: no merges at all
MAX_VOCAB = 2**16      # the corpus is stored as uint16


def _byte_decoder() -> dict[str, int]:
    """The byte-level alphabet: each printable stand-in character -> the byte it encodes (GPT-2's table)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class Tokenizer:
    """A trained tokenizer. `vocab_size` is the real number of tokens (a tiny corpus may give fewer merges than
    asked for); `bos_id` is the id of `<|bos|>`."""

    def __init__(self, hf: _HFTokenizer):
        self._tok = hf
        self.vocab_size: int = hf.get_vocab_size()
        bos = hf.token_to_id(BOS)
        if bos is None:
            raise ValueError(f"tokenizer has no {BOS} token; it was not made by this harness")
        self.bos_id: int = bos

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
            raise ValueError(f"vocab size {vocab_size} is out of range; use {MIN_VOCAB}..{MAX_VOCAB}")
        tok = _HFTokenizer(models.BPE(byte_fallback=False, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            show_progress=False,
            special_tokens=[BOS],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no unknown tokens
        )
        tok.train_from_iterator(_batched(texts), trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, tok_dir: Path) -> "Tokenizer":
        path = Path(tok_dir) / "tokenizer.json"
        try:
            return cls(_HFTokenizer.from_file(str(path)))
        except Exception as e:  # the Rust side raises a bare Exception on a missing or bad file
            from .errors import DataError
            raise DataError(f"cannot load tokenizer {path}: {e}; run `ar prepare` for this dataset again") from None

    def save(self, tok_dir: Path) -> None:
        tok_dir = Path(tok_dir)
        tok_dir.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(tok_dir / "tokenizer.json"))
        np.save(tok_dir / "token_bytes.npy", self.token_bytes())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking; both run in parallel on Rust threads
        enc = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in enc(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """int32 [vocab_size]: how many UTF-8 bytes each token stands for; 0 for special tokens."""
        table = _byte_decoder()
        out = np.zeros(self.vocab_size, dtype=np.int32)
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        for token, i in self._tok.get_vocab(with_added_tokens=True).items():
            if token in special:
                continue
            assert all(c in table for c in token), f"token {token!r} is not byte-level"
            out[i] = len(token)  # one stand-in character per byte
        return out

    def sha256(self) -> str:
        import hashlib
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()


def _batched(texts: Iterable[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for t in texts:
        batch.append(t)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
