import io
import json
import shutil
import sysconfig
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from autoresearch.errors import DataError
from autoresearch.harness import data, download
from autoresearch.harness.tokenizer import Tokenizer

from test_loop import no_ar_settings  # noqa: F401  (a fixture, asked for by name)

VOCAB = 300


def docs_of(tok_dir: Path, split: str) -> list[str]:
    tokens = np.fromfile(tok_dir / f"{split}.bin", dtype=np.uint16)
    idx = np.load(tok_dir / f"{split}.idx.npy")
    tok = Tokenizer.load(tok_dir)
    assert idx[0] == 0 and idx[-1] == tokens.size and (np.diff(idx) >= 1).all()
    assert (tokens[idx[:-1]] == tok.bos_id).all()  # every document starts with BOS
    return [tok.decode(tokens[a + 1:b]) for a, b in zip(idx[:-1], idx[1:])]


def write_parquet(path: Path, texts, column="text") -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({column: texts}), buf)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def small_text(folder: Path, n: int = 60, start: int = 0) -> Path:
    """n short documents of real text (a few hundred characters each): a dataset that prepares in a second."""
    import sysconfig
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    pieces = [p for f in sorted(stdlib.glob("*.py"))[:40] for p in data.split_long(f.read_text(errors="replace"), 600)]
    for i, piece in enumerate(pieces[start:start + n]):
        (folder / f"doc_{i:04d}.txt").write_text(piece)
    return folder


# ---- builtin ------------------------------------------------------------------------------------------------

def test_builtin_layout_and_determinism(tmp_path):
    msgs = []
    tok = data.prepare("builtin", cache=tmp_path / "a", vocab_size=VOCAB, max_bytes=150_000, progress=msgs.append)
    assert tok == tmp_path / "a" / "builtin" / f"tok-{VOCAB}"
    for f in ("tokenizer.json", "token_bytes.npy", "train.bin", "val.bin", "train.idx.npy", "val.idx.npy", "meta.json"):
        assert (tok / f).is_file()
    meta = data.load_meta(tok)
    assert meta["source"] == "builtin" and meta["vocab_size"] == VOCAB and meta["val"]["docs"] >= 1
    raw = json.loads((tmp_path / "a" / "builtin" / "raw.json").read_text())
    assert raw["train"] and raw["val"] and all((tmp_path / "a" / "builtin" / f).is_file() for f in raw["train"] + raw["val"])
    assert not [p for p in (tmp_path / "a" / "builtin").iterdir() if p.name.startswith(".")]  # no temp leftovers
    train = docs_of(tok, "train")
    assert len(train) == meta["train"]["docs"] and all(len(d) <= data.DOC_MAX_CHARS for d in train)
    assert data.check_prepared(tmp_path / "a", "builtin", VOCAB) == tok
    # same text, same key (the installation's, outside the cache), same split, same tokens, in another cache
    other = data.load_meta(data.prepare("builtin", cache=tmp_path / "b", vocab_size=VOCAB, max_bytes=150_000))
    for key in ("raw_sha256", "tokenizer_sha256"):
        assert other[key] == meta[key]
    assert other["val"] == meta["val"] and other["train"] == meta["train"]
    # idempotent: a second prepare keeps the tokenized folder
    msgs.clear()
    data.prepare("builtin", cache=tmp_path / "a", vocab_size=VOCAB, max_bytes=150_000, progress=msgs.append)
    assert any("already prepared" in m for m in msgs)
    assert data.load_meta(tok)["created_at"] == meta["created_at"]


def test_builtin_validation_comes_from_the_hidden_test_suite_by_a_secret_key(tmp_path, monkeypatch):
    """The validation documents of `builtin` are files no run needs (the stdlib's test suite), which the sandbox
    hides; which of them is a secret of the installation, so replaying the split over readable files fails."""
    test_dir = Path(sysconfig.get_paths()["stdlib"]) / "test"
    if not test_dir.is_dir():
        pytest.skip("this Python has no Lib/test")
    vals = []
    for cache in ("a", "b"):                                                 # two installations, two keys
        monkeypatch.setenv("AR_SECRET_DIR", str(tmp_path / f"secret-{cache}"))
        tok = data.prepare("builtin", cache=tmp_path / cache, vocab_size=VOCAB, max_bytes=150_000)
        raw = json.loads((tok.parent / "raw.json").read_text())
        assert raw["hidden"] == [str(test_dir.resolve())] and raw["val_readable"] is False
        assert str(test_dir.resolve()) in data.hidden_sources(tok) and not data.validation_readable(tok)
        key = tmp_path / f"secret-{cache}" / "split.key"
        assert key.stat().st_mode & 0o077 == 0 and str(key.parent) in data.hidden_sources(tok)
        vals.append(docs_of(tok, "val"))
        sources = "".join(p.read_text(errors="replace") for p in test_dir.rglob("*.py"))
        assert vals[-1] and all(d[:300] in sources for d in vals[-1])        # from the test suite only
    assert vals[0] != vals[1]                                                # another key, another split


@pytest.mark.usefixtures("no_ar_settings")
def test_the_split_key_lives_outside_the_cache_so_a_rebuilt_cache_splits_the_same(tmp_path, monkeypatch):
    secret = tmp_path / "state" / "secret"
    monkeypatch.setenv("AR_SECRET_DIR", str(secret))
    text = small_text(tmp_path / "text")
    cache = tmp_path / "cache"
    first = data.load_meta(data.prepare("files", cache=cache, vocab_size=300, path=text))
    key = secret / "split.key"
    assert key.is_file() and key.stat().st_mode & 0o077 == 0 and len(key.read_text().strip()) == 64
    assert not (cache / ".secret").exists()                              # not in the cache any more
    tok = data.tokenized_dir(data.dataset_dir(cache, "files"), 300)
    assert str(secret) in data.hidden_sources(tok)                       # the sandboxes hide it
    shutil.rmtree(cache)                                                 # rm -rf ~/.cache/autoresearch
    again = data.load_meta(data.prepare("files", cache=cache, vocab_size=300, path=text))
    assert again["val"] == first["val"] and again["raw_sha256"] == first["raw_sha256"]
    # a cache that holds a key of its own (an older ar's, or the tests' empty one) keeps splitting by it
    (tmp_path / "old" / ".secret").mkdir(parents=True)
    (tmp_path / "old" / ".secret" / "split.key").write_text("")
    assert data.split_key(tmp_path / "old") == b"" and data.split_key(cache) == bytes.fromhex(key.read_text())


def test_builtin_files_exclude_site_packages():
    keys = [k for k, _ in data.builtin_files()]
    assert keys == sorted(keys) and "stdlib/os.py" in keys
    assert not any("site-packages" in k or k.startswith("site/") for k in keys)


def test_split_long():
    text = "".join(f"line {i}\n" + ("\n" if i % 7 == 0 else "") for i in range(2000))
    pieces = data.split_long(text, 500)
    assert "".join(pieces) == text and all(0 < len(p) <= 500 for p in pieces)
    assert data.split_long("x" * 1234, 500) == ["x" * 500, "x" * 500, "x" * 234]
    assert data.split_long("", 10) == []


# ---- files --------------------------------------------------------------------------------------------------

def test_files_mixed_formats(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    texts = {f"txt {i}: " + "some words " * (i + 5) for i in range(30)}
    for i, t in enumerate(sorted(texts)[:10]):
        (src / f"a{i:02d}.txt").write_text(t)
    with open(src / "sub" / "b.jsonl", "w") as f:
        for t in sorted(texts)[10:20]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n\n")
    write_parquet(src / "c.parquet", sorted(texts)[20:])
    (src / ".hidden.txt").write_text("never read")
    (src / "notes.md").write_text("not a data file")
    tok = data.prepare("files", cache=tmp_path / "cache", vocab_size=VOCAB, path=src, name="mine")
    got = docs_of(tok, "train") + docs_of(tok, "val")
    assert sorted(got) == sorted(texts)
    meta = data.load_meta(tok)
    assert meta["dataset"] == "mine" and meta["val"]["docs"] >= 1 and meta["train"]["docs"] >= 1


def test_two_documents_give_one_each(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("first document " * 50)
    (src / "b.txt").write_text("second document " * 50)
    meta = data.load_meta(data.prepare("files", cache=tmp_path / "c", vocab_size=VOCAB, path=src))
    assert meta["train"]["docs"] == 1 and meta["val"]["docs"] == 1


def test_max_bytes_caps_the_corpus(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"{i:02d}.txt").write_text(f"document {i} " * 100)
    meta = data.load_meta(data.prepare("files", cache=tmp_path / "c", vocab_size=VOCAB, path=src, max_bytes=3000))
    assert meta["train"]["docs"] + meta["val"]["docs"] == 3


@pytest.mark.parametrize("setup, match", [
    (lambda d: None, "has no .parquet, .jsonl or .txt files"),
    (lambda d: write_parquet(d / "x.parquet", ["a", "b"], column="content"), r"x\.parquet has no `text` column.*content"),
    (lambda d: write_parquet(d / "x.parquet", [1, 2], column="text"), r"x\.parquet: column `text` holds int64"),
    (lambda d: (d / "x.jsonl").write_text('{"text": "ok"}\n{"body": "no"}\n'), r"x\.jsonl:2 has no string `text` field"),
    (lambda d: (d / "x.jsonl").write_text('{"text": "ok"}\nnot json\n'), r"x\.jsonl:2 is not valid JSON"),
    (lambda d: (d / "x.parquet").write_bytes(b"PAR1 this is not parquet"), r"x\.parquet is not a readable parquet"),
    (lambda d: (d / "x.txt").write_text("only one document"), "needs at least 2"),
])
def test_files_bad_input(tmp_path, setup, match):
    src = tmp_path / "src"
    src.mkdir()
    setup(src)
    with pytest.raises(DataError, match=match):
        data.prepare("files", cache=tmp_path / "c", vocab_size=VOCAB, path=src)


def test_truncated_parquet(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    blob = write_parquet(src / "x.parquet", [f"document {i} " * 50 for i in range(200)])
    (src / "x.parquet").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match=r"x\.parquet .*(corrupt|not a readable)"):
        data.prepare("files", cache=tmp_path / "c", vocab_size=VOCAB, path=src)


def test_files_needs_a_folder(tmp_path):
    with pytest.raises(DataError, match="needs a folder"):
        data.prepare("files", cache=tmp_path, vocab_size=VOCAB)
    with pytest.raises(DataError, match="is not a folder"):
        data.prepare("files", cache=tmp_path, vocab_size=VOCAB, path=tmp_path / "nope")
    assert not (tmp_path / "files").exists()


def test_bad_arguments(tmp_path):
    with pytest.raises(DataError, match="unknown data source"):
        data.prepare("nope", cache=tmp_path, vocab_size=VOCAB)
    with pytest.raises(DataError, match="vocab size"):
        data.prepare("builtin", cache=tmp_path, vocab_size=70000)
    with pytest.raises(DataError, match="plain folder name"):
        data.prepare("builtin", cache=tmp_path, vocab_size=VOCAB, name="../x")


# ---- not prepared, half prepared, corrupt -------------------------------------------------------------------

def test_check_prepared_missing(tmp_path):
    with pytest.raises(DataError, match=r"run `ar prepare builtin --vocab-size 512`"):
        data.check_prepared(tmp_path, "builtin", 512)


def test_half_prepared_is_not_prepared_and_corruption_is_repaired(tmp_path, tiny_dataset):
    import shutil
    cache = tmp_path / "cache"
    shutil.copytree(tiny_dataset.cache, cache)
    tok = data.check_prepared(cache, tiny_dataset.name, tiny_dataset.vocab_size)
    bin_ = tok / "train.bin"
    bin_.write_bytes(bin_.read_bytes()[:-10])
    with pytest.raises(DataError, match=r"train\.bin has .* bytes.*ar prepare files --path .* --name tiny"):
        data.check_prepared(cache, tiny_dataset.name, tiny_dataset.vocab_size)
    data.prepare("files", cache=cache, vocab_size=tiny_dataset.vocab_size, name="tiny", path=tiny_dataset.path)
    assert data.check_prepared(cache, tiny_dataset.name, tiny_dataset.vocab_size) == tok
    (tok / "meta.json").unlink()  # e.g. killed before the last write
    with pytest.raises(DataError, match="meta.json"):
        data.check_prepared(cache, tiny_dataset.name, tiny_dataset.vocab_size)


# ---- climbmix from a fake hub -------------------------------------------------------------------------------

class FakeHub:
    """Serves parquet files from memory on 127.0.0.1. `plan[name]` lists what the next requests get:
    "500", "404", "truncate" (half the body, full Content-Length), "garbage", then the file (with Range)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.plan, self.log = files, {}, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                rng = self.headers.get("Range")
                hub.log.append((name, rng))
                action = hub.plan.get(name, []).pop(0) if hub.plan.get(name) else "ok"
                body = hub.files.get(name)
                if action == "404" or body is None:
                    return self.send_error(404)
                if action == "500":
                    return self.send_error(500)
                if action == "garbage":
                    body = b"<html>not parquet</html>"
                start = int(rng.split("=")[1].split("-")[0]) if rng and action != "garbage" else 0
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                chunk = body[start:]
                self.wfile.write(chunk[: len(chunk) // 2] if action == "truncate" else chunk)
                if action == "truncate":
                    self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/resolve/main"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setattr(download, "BACKOFF_S", 0.01)
    monkeypatch.setattr(download, "RETRIES", 3)
    files = {}
    rng = np.random.default_rng(0)
    for i in (0, 1, 7):
        buf = io.BytesIO()
        noise = [" ".join(map(str, rng.integers(0, 10**6, 100))) for _ in range(300)]  # ~200 KB: several chunks
        texts = [f"shard {i} document {j}: " + noise[j] for j in range(300)]
        pq.write_table(pa.table({"text": texts, "id": list(range(300))}), buf, row_group_size=50)
        files[data.shard_name(i)] = buf.getvalue()
    h = FakeHub(files)
    yield h
    h.close()


def climbmix(hub, cache, **kw):
    return data.prepare("climbmix", cache=cache, vocab_size=VOCAB, num_shards=2, val_shard=7, base_url=hub.url,
                        workers=3, **kw)


def test_climbmix_500_then_success_and_truncated_body(hub, tmp_path):
    hub.plan = {"shard_00000.parquet": ["500", "500"], "shard_00001.parquet": ["truncate"]}
    tok = climbmix(hub, tmp_path)
    ddir = tmp_path / "climbmix"
    for name, blob in hub.files.items():
        assert (ddir / name).read_bytes() == blob
    assert [r for n, r in hub.log if n == "shard_00000.parquet"] == [None, None, None]
    ranges = [r for n, r in hub.log if n == "shard_00001.parquet"]
    assert ranges[0] is None and len(ranges) == 2
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))  # what reached the disk before the cut
    assert 0 < resumed_at <= len(hub.files["shard_00001.parquet"]) // 2
    meta = data.load_meta(tok)
    assert meta["train"]["docs"] == 600 and meta["val"]["docs"] == 300
    assert docs_of(tok, "val")[0].startswith("shard 7 document 0:")
    assert not list(ddir.glob("*.part"))
    hub.log.clear()  # a second prepare downloads nothing
    climbmix(hub, tmp_path)
    assert hub.log == []


def test_climbmix_resumes_a_partial_file(hub, tmp_path):
    ddir = tmp_path / "climbmix"
    ddir.mkdir()
    blob = hub.files["shard_00001.parquet"]
    (ddir / "shard_00001.parquet.part").write_bytes(blob[:1000])
    climbmix(hub, tmp_path)
    assert ("shard_00001.parquet", "bytes=1000-") in hub.log
    assert (ddir / "shard_00001.parquet").read_bytes() == blob


def test_climbmix_404_names_the_url(hub, tmp_path):
    hub.plan = {"shard_00001.parquet": ["404"]}
    with pytest.raises(DataError, match=r"/resolve/main/shard_00001\.parquet does not exist \(HTTP 404\)"):
        climbmix(hub, tmp_path)


def test_climbmix_gives_up_after_retries(hub, tmp_path):
    hub.plan = {"shard_00000.parquet": ["500"] * 10}
    with pytest.raises(DataError, match=r"shard_00000\.parquet failed after 4 attempts.*HTTP 500.*again to resume"):
        climbmix(hub, tmp_path)


def test_climbmix_body_not_parquet(hub, tmp_path):
    hub.plan = {"shard_00000.parquet": ["garbage"] * 10}
    with pytest.raises(DataError, match="not a readable parquet"):
        climbmix(hub, tmp_path)
    assert not (tmp_path / "climbmix" / "shard_00000.parquet").exists()


def test_climbmix_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(download, "BACKOFF_S", 0.01)
    monkeypatch.setattr(download, "RETRIES", 1)
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(DataError, match=r"network is unreachable.*`ar prepare builtin` works offline") as e:
        data.prepare("climbmix", cache=tmp_path, vocab_size=VOCAB, num_shards=1, base_url=f"http://127.0.0.1:{port}")
    assert "\n" not in str(e.value)


def test_climbmix_shard_arguments(tmp_path):
    with pytest.raises(DataError, match="among the 3 training shards"):
        data.prepare("climbmix", cache=tmp_path, vocab_size=VOCAB, num_shards=3, val_shard=2)
    with pytest.raises(DataError, match="at least one training shard"):
        data.prepare("climbmix", cache=tmp_path, vocab_size=VOCAB, num_shards=0)


# ---- the command --------------------------------------------------------------------------------------------

def test_cli_prepare(tmp_path, isolated_cache):
    from typer.testing import CliRunner

    from autoresearch.cli import app
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"{i}.txt").write_text(f"document number {i}. " * 40)
    result = CliRunner().invoke(app, ["prepare", "files", "--path", str(src), "--name", "mine", "--vocab-size", "300"])
    assert result.exit_code == 0, result.output
    assert "prepared mine (files)" in result.output
    assert data.check_prepared(isolated_cache, "mine", 300).is_dir()
    result = CliRunner().invoke(app, ["prepare", "files", "--path", str(tmp_path / "nope")])
    assert result.exit_code != 0 and isinstance(result.exception, DataError)
