import numpy as np
import pytest

from autoresearch.harness.tokenizer import BOS, Tokenizer

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 20,
    "Ünïcödé text, 日本語のテキスト, emoji 😀🚀 and numbers 1234567890.\n" * 10,
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = [1, 2, 3]\n" * 10,
]
SAMPLES = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "Ünïcödé 日本語 😀 — unseen: Ωμέγα ☃ 𝔘",
    "x = {'a': 1, \"b\": [2.5e-3, None]}  # comment",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(CORPUS, 300)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.bos_id not in ids  # BOS is placed by the corpus writer, never by encode


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_sum_to_utf8_length(tok, text):
    table = tok.token_bytes()
    assert int(table[tok.encode(text)].sum()) == len(text.encode("utf-8"))


def test_token_bytes_table(tok):
    table = tok.token_bytes()
    assert table.dtype == np.int32 and table.shape == (tok.vocab_size,)
    assert table[tok.bos_id] == 0
    assert (np.delete(table, tok.bos_id) >= 1).all()
    assert tok.decode([tok.bos_id]) == BOS


def test_vocab_size_as_asked(tok):
    assert tok.vocab_size == 300


def test_save_load(tok, tmp_path):
    tok.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert again.vocab_size == tok.vocab_size and again.bos_id == tok.bos_id
    for text in SAMPLES:
        assert again.encode(text) == tok.encode(text)
    assert (np.load(tmp_path / "token_bytes.npy") == tok.token_bytes()).all()
    assert again.sha256() == tok.sha256()


def test_encode_batch_matches_encode(tok):
    assert tok.encode_batch(SAMPLES) == [tok.encode(t) for t in SAMPLES]


def test_deterministic_training():
    assert Tokenizer.train(CORPUS, 300).sha256() == Tokenizer.train(CORPUS, 300).sha256()


@pytest.mark.parametrize("vocab", [100, 2**16 + 1])
def test_vocab_out_of_range(vocab):
    with pytest.raises(ValueError, match="vocab size"):
        Tokenizer.train(CORPUS, vocab)


def test_load_missing(tmp_path):
    from autoresearch.errors import DataError
    with pytest.raises(DataError, match="ar prepare"):
        Tokenizer.load(tmp_path)
