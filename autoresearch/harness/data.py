"""Data sources, the cache layout, and `prepare()`: raw text -> tokenizer -> tokenized corpus.

Layout (one folder per dataset, so that switching datasets never mixes them)::

    <cache>/<name>/raw.json               which raw shards are train and which validation (written last)
    <cache>/<name>/*.parquet              raw text shards with a `text` column
    <cache>/<name>/tok-<vocab>/           tokenizer.json, token_bytes.npy,
                                          train.bin / val.bin        uint16 ids, each document [BOS] + tokens
                                          train.idx.npy / val.idx.npy  int64 document starts, ndocs + 1 entries
                                          meta.json                  counts, hashes (written last)

Every file is written to a temporary name and renamed into place; a folder without meta.json is not prepared.

Sources:
- `climbmix`: parquet shards of karpathy/climbmix-400b-shuffle from the Hugging Face hub, as upstream
  autoresearch takes them: `shard_00000.parquet` ... `shard_06542.parquet`, the first `num_shards` (default 10)
  for training and the last one, `shard_06542`, pinned for validation. Base URL, shard count and validation
  shard are parameters, in case the hub layout changes. `download.py` fetches them (resumed, retried, checked).
- `files`: a folder of `.parquet` (a `text` column), `.jsonl` (a `text` field per line) or `.txt` (one document
  per file), read in sorted path order.
- `builtin`: the running Python's standard library sources (offline, deterministic for a given Python).
  `builtin-site`: the same plus every .py/.md/.txt/.rst file in site-packages (hundreds of millions of tokens
  where torch is installed). Long files are cut at blank lines into documents of at most DOC_MAX_CHARS:
  best-fit packing crops a document that fits no row and drops its tail, so whole 100 KB files would be
  trained (and evaluated) on their first page only: with whole files about 27% of the stdlib's tokens would
  ever reach a 2048-token row, with 4000-character pieces 85% (vocab 8192, bench/bench_loader.py).
Validation for `files` is picked by a keyed hash of each document's path (and row), VAL_FRACTION of them, at
least one; the key is this installation's secret (`~/.config/ar/secret/split.key`, or $AR_SECRET_DIR; made on
first use, outside the cache so that a rebuilt cache splits the same; a cache with a `.secret/split.key` of its
own, an older ar's, keeps splitting by that; no sandboxed process can read either), so the split cannot be
replayed from the harness's code. Validation for `builtin*`
comes only from the standard library's own test suite (`Lib/test`, VAL_TEST_FRACTION of its documents by the
keyed hash, the rest train): no run needs those files, and the sandbox hides them (`hidden_sources`) from
training, the model worker and the agent. Where a Python has no `Lib/test`, validation falls back to the keyed
hash over every file, which proposal code can read: raw.json then says `val_readable` and `ar run` says so and
marks every result. So does a test suite under MIN_TEST_SUITE_BYTES (distributions often ship only a stub of it:
one GPU host's gave 9,695 validation tokens).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import os
import shutil
import site
import sysconfig
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import DataError
from .download import Progress, download, download_all, one_line  # noqa: F401  (download: re-exported)
from .tokenizer import MAX_VOCAB, MIN_VOCAB, Tokenizer

SOURCES = ("climbmix", "files", "builtin", "builtin-site")
FORMAT = 2                                   # bump when the tokenized layout or the split rule changes

CLIMBMIX_BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
CLIMBMIX_TRAIN_SHARDS = 10                   # upstream's default download
CLIMBMIX_VAL_SHARD = 6542                    # the last shard, pinned for validation

VAL_FRACTION = 0.05
VAL_TEST_FRACTION = 0.1                      # of the stdlib's test suite (about half its sources): ~5% of builtin
DOC_MAX_CHARS = 4000                         # ~1k tokens: small enough for best-fit to fill 2048-rows
TOKENIZER_SAMPLE_CHARS = 200_000_000         # BPE is trained on this much training text at most
RAW_SHARD_CHARS = 256_000_000
ENCODE_BATCH_CHARS = 16_000_000


def dataset_dir(cache: Path, name: str) -> Path:
    return Path(cache) / name


def tokenized_dir(data_dir: Path, vocab_size: int) -> Path:
    return Path(data_dir) / f"tok-{vocab_size}"


def load_meta(tok_dir: Path) -> dict:
    return json.loads((Path(tok_dir) / "meta.json").read_text())


def prepare(source: str, *, cache: Path, vocab_size: int, name: str | None = None, path: Path | None = None,
            num_shards: int | None = None, base_url: str | None = None, workers: int = 8,
            max_bytes: int | None = None, progress: Progress | None = None,
            val_shard: int | None = None) -> Path:
    """Get the raw text of `source` into `<cache>/<name>` and tokenize it; return the tokenized folder.

    Idempotent: a dataset already tokenized from the same raw text is left as it is."""
    say = progress or (lambda _msg: None)
    if source not in SOURCES:
        raise DataError(f"unknown data source {source!r}; use one of: {', '.join(SOURCES)}")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise DataError(f"vocab size {vocab_size} is out of range; use {MIN_VOCAB}..{MAX_VOCAB}")
    name = name or source
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise DataError(f"dataset name {name!r} must be a plain folder name (no slashes, not starting with '.')")
    ddir = dataset_dir(cache, name)
    if source == "climbmix":
        ddir.mkdir(parents=True, exist_ok=True)
        raw = _climbmix_raw(ddir, num_shards=num_shards, base_url=base_url, val_shard=val_shard,
                            workers=workers, say=say)
    else:
        key = split_key(cache)
        if source == "files":
            if path is None:
                raise DataError("the `files` source needs a folder: `ar prepare files --path DIR`")
            docs = _cap(_files_docs(Path(path), _list_files(Path(path))), max_bytes)
            params = {"path": str(Path(path).resolve())}
            hidden, val_only = [str(Path(path).resolve())], None
        else:
            test_dir = Path(sysconfig.get_paths()["stdlib"]) / "test"
            val_only = (lambda k: k.startswith(VAL_KEY_PREFIX)) if _py_bytes(test_dir) >= MIN_TEST_SUITE_BYTES \
                else None
            files = builtin_files(site_packages=source == "builtin-site")
            # the test suite in the keyed order (a capped corpus then takes validation documents first, a tenth
            # of the cap), the rest in path order
            held_out = sorted((f for f in files if val_only and val_only(f[0])), key=lambda f: _key_hash(f[0], key))
            rest = [f for f in files if not (val_only and val_only(f[0]))]
            docs = iter([*_cap(_file_docs(held_out), max(1, max_bytes // 10)), *_cap(_file_docs(rest), max_bytes)]) \
                if max_bytes else _file_docs(held_out + rest)
            params = {"python": sysconfig.get_python_version()}
            hidden = [str(test_dir.resolve())] if val_only else []
        say(f"collecting {source} text into {ddir}")
        ddir.mkdir(parents=True, exist_ok=True)
        raw = _write_raw(ddir, docs, source=source, params={**params, "max_bytes": max_bytes}, secret=key,
                         val_only=val_only, hidden=hidden)
    return _tokenize(ddir, raw, vocab_size=vocab_size, name=name, say=say)


def check_prepared(cache: Path, name: str, vocab_size: int) -> Path:
    """The tokenized folder of a prepared dataset, or a DataError that says how to prepare it."""
    tok = tokenized_dir(dataset_dir(cache, name), vocab_size)
    problem = _tok_problem(tok)
    if problem:
        raise DataError(f"dataset {name!r} is not prepared for vocab {vocab_size} in {cache} ({problem}); "
                        f"run `{_prepare_hint(cache, name, vocab_size)}`")
    return tok


def check_tok_dir(tok_dir: Path, splits: tuple[str, ...] = ("train", "val")) -> dict:
    """The meta.json of a complete tokenized folder, or a DataError saying what is wrong with it. A training
    run under ar sees a view without tokens (`train_view`; its tokens come from ar's feed)."""
    tok_dir = Path(tok_dir)
    problem = _tok_problem(tok_dir, splits)
    if problem:
        name, vocab = tok_dir.parent.name, tok_dir.name.removeprefix("tok-")
        hint = _prepare_hint(tok_dir.parent.parent, name, int(vocab)) if vocab.isdigit() else "ar prepare"
        raise DataError(f"{tok_dir} is not a prepared dataset ({problem}); run `{hint}`")
    return load_meta(tok_dir)


TRAIN_FILES = ("meta.json", "tokenizer.json", "train.bin", "train.idx.npy")
VIEW_FILES = ("meta.json", "tokenizer.json")     # what a run under ar may read: its tokens come from the feed


def train_view(tok_dir: Path, dest: Path) -> list[Path]:
    """A folder of links to what a sandboxed run may read of the dataset: its meta.json and tokenizer (no split:
    the training tokens come through ar's feed, harness/feed.py; no validation, no token-bytes table); returns the
    real files it links to, which the sandbox must let the run read."""
    dest.mkdir(parents=True, exist_ok=True)
    real = []
    for name in VIEW_FILES:
        src = (Path(tok_dir) / name).resolve()
        (dest / name).symlink_to(src)
        real.append(src)
    return real


# ---- checks ------------------------------------------------------------------------------------------------

def _tok_problem(tok: Path, splits: tuple[str, ...] = ("train", "val")) -> str | None:
    if not (tok / "meta.json").is_file():
        return f"no {tok / 'meta.json'}"
    try:
        meta = load_meta(tok)
        if meta.get("format") != FORMAT:
            return f"{tok} was made by another version of the harness"
        for name in ("tokenizer.json", "token_bytes.npy") if "val" in splits else ("tokenizer.json",):
            if not (tok / name).is_file():
                return f"{tok / name} is missing"
        for split in splits:
            counts = meta[split]
            size = (tok / f"{split}.bin").stat().st_size
            if size != 2 * counts["tokens"]:
                return f"{split}.bin has {size} bytes, meta.json says {2 * counts['tokens']}"
            idx = np.load(tok / f"{split}.idx.npy", mmap_mode="r")
            if idx.shape != (counts["docs"] + 1,):
                return f"{split}.idx.npy has {idx.shape[0]} entries, meta.json says {counts['docs'] + 1}"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{tok} is corrupt: {one_line(e)}"
    return None


def _prepare_hint(cache: Path, name: str, vocab_size: int) -> str:
    raw = _read_raw(dataset_dir(cache, name)) or {}
    source = raw.get("source") or (name if name in SOURCES else None)
    named = "" if name == source else f" --name {name}"
    if source == "files":
        path = raw.get("params", {}).get("path", "DIR")
        return f"ar prepare files --path {path}{named} --vocab-size {vocab_size}"
    if source:
        return f"ar prepare {source}{named} --vocab-size {vocab_size}"
    return f"ar prepare builtin --vocab-size {vocab_size}` (or `ar prepare files --path DIR --name {name}"


# ---- raw text: reading -------------------------------------------------------------------------------------

def parquet_texts(path: Path) -> Iterator[str]:
    """The non-empty `text` values of a parquet file; DataError naming the file if it is not one."""
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        names = schema.names
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable parquet file, corrupt or truncated ({one_line(e)}); "
                        "delete or replace it and run `ar prepare` again") from None
    if "text" not in names:
        raise DataError(f"{path} has no `text` column (it has: {', '.join(names) or 'none'}); "
                        "name the column that holds the documents `text`")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column `text` holds {kind}, not strings; store the documents as strings")
    try:
        for batch in pf.iter_batches(columns=["text"], batch_size=1024):
            for t in batch.column(0).to_pylist():
                if t:
                    yield t
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is corrupt or truncated ({one_line(e)}); "
                        "delete or replace it and run `ar prepare` again") from None


def _list_files(root: Path) -> list[Path]:
    if not root.is_dir():
        raise DataError(f"{root} is not a folder; give `--path` a folder of .parquet, .jsonl or .txt files")
    files = sorted((p for p in root.rglob("*") if p.suffix in (".parquet", ".jsonl", ".txt") and p.is_file()
                    and not any(part.startswith(".") for part in p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"{root} has no .parquet, .jsonl or .txt files; put the training text there")
    return files


def _files_docs(root: Path, files: list[Path]) -> Iterator[tuple[str, str]]:
    for f in files:
        rel = f.relative_to(root).as_posix()
        if f.suffix == ".txt":
            yield rel, f.read_text(encoding="utf-8", errors="replace")
        elif f.suffix == ".parquet":
            for i, text in enumerate(parquet_texts(f)):
                yield f"{rel}:{i}", text
        else:
            yield from _jsonl_docs(f, rel)


def _jsonl_docs(f: Path, rel: str) -> Iterator[tuple[str, str]]:
    with open(f, encoding="utf-8", errors="replace") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{f}:{i} is not valid JSON; each line of a .jsonl must be one object") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{f}:{i} has no string `text` field; each line needs {{\"text\": \"...\"}}")
            yield f"{rel}:{i}", obj["text"]


def builtin_files(site_packages: bool = False) -> list[tuple[str, Path]]:
    """(key, path) of the builtin corpus, sorted by key: `stdlib/<rel>` for the standard library's .py files,
    `site/<rel>` for site-packages' .py/.md/.txt/.rst files."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    out = [(f"stdlib/{p.relative_to(stdlib).as_posix()}", p) for p in _walk(stdlib, (".py",), skip)]
    if site_packages:
        roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
        seen: set[str] = set()
        for root in sorted({Path(r).resolve() for r in roots if Path(r).is_dir()}):
            for p in _walk(root, (".py", ".md", ".txt", ".rst"), {"__pycache__"}):
                key = f"site/{p.relative_to(root).as_posix()}"
                if key not in seen:
                    seen.add(key)
                    out.append((key, p))
    return sorted(out)


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str]) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for f in filenames:
            if f.endswith(suffixes):
                p = Path(dirpath) / f
                if p.is_file():
                    yield p


VAL_KEY_PREFIX = "stdlib/test/"             # the builtin corpus's validation documents come from here only
MIN_TEST_SUITE_BYTES = 4_000_000             # a test suite smaller than this (distributions ship a stub) gives too
                                             # little validation text: then the keyed split over every file, said


def _py_bytes(folder: Path) -> int:
    """Bytes of Python source under `folder` (0 when it is missing)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if f.endswith(".py"))
    return total


SECRET_DIR = "~/.config/ar/secret"          # the installation's split key: user state, outside the cache


def secret_dir() -> Path:
    """Where this installation's split key lives: $AR_SECRET_DIR, else ~/.config/ar/secret. Outside the cache on
    purpose: deleting the cache and preparing again gives the same split (a tag's results keep comparing)."""
    return Path(os.environ.get("AR_SECRET_DIR") or os.path.expanduser(SECRET_DIR))


def split_key(cache: Path) -> bytes:
    """This installation's secret split key (readable by the user only, and by no sandbox). A cache that holds a
    key of its own (`<cache>/.secret/split.key`: an older ar kept it there; the tests' fixture writes an empty
    one, the unkeyed rule) splits by it; else the key in `secret_dir()`, made on first use."""
    own = Path(cache) / ".secret" / "split.key"
    try:
        return bytes.fromhex(own.read_text().strip())
    except (OSError, ValueError):
        pass
    folder = secret_dir()
    f = folder / "split.key"
    try:
        return bytes.fromhex(f.read_text().strip())
    except (OSError, ValueError):
        pass
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    tmp = folder / f".split.key.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secrets.token_hex(32))
    try:
        os.link(tmp, f)                              # the first writer wins; every other reads its key
    except FileExistsError:
        pass
    tmp.unlink()
    return bytes.fromhex(f.read_text().strip())


def key_path(cache: Path) -> Path:
    """The split key file `split_key(cache)` reads (or would make)."""
    own = Path(cache) / ".secret" / "split.key"
    return own if own.is_file() else secret_dir() / "split.key"


def hidden_sources(tok_dir: Path | None) -> list[str]:
    """What proposal code must not read for this prepared dataset: the raw files its validation text comes from
    (raw.json's `hidden`) and the installation's split key (the cache's own, and the one in `secret_dir()`)."""
    if tok_dir is None:
        return []
    ddir = Path(tok_dir).parent
    raw = _read_raw(ddir) or {}
    mine = [str(secret_dir())] if secret_dir().exists() else []     # a policy names only what is there to hide
    return [*raw.get("hidden", []), str(ddir.parent / ".secret"), *mine]


def validation_readable(tok_dir: Path | None) -> bool:
    """True when the dataset's validation text comes from files proposal code can read (raw.json says so)."""
    return tok_dir is not None and bool((_read_raw(Path(tok_dir).parent) or {}).get("val_readable"))


def _builtin_docs(site_packages: bool) -> Iterator[tuple[str, str]]:
    return _file_docs(builtin_files(site_packages))


def _file_docs(files: list[tuple[str, Path]]) -> Iterator[tuple[str, str]]:
    for key, p in files:
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # an unreadable file in site-packages is no reason to fail
        for piece in split_long(text, DOC_MAX_CHARS):
            yield key, piece  # all pieces of a file share its key, so they land in the same split


def split_long(text: str, max_chars: int) -> list[str]:
    """Cut `text` into pieces of at most `max_chars`, at a blank line where there is one in the second half
    of a piece, else at a line end, else anywhere."""
    if len(text) <= max_chars:
        return [text] if text else []
    pieces, start, n = [], 0, len(text)
    while n - start > max_chars:
        end = start + max_chars
        cut = text.rfind("\n\n", start + max_chars // 2, end)
        if cut < 0:
            cut = text.rfind("\n", start + max_chars // 2, end)
        cut = end if cut < 0 else cut + 1
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _cap(docs: Iterable[tuple[str, str]], max_bytes: int | None) -> Iterator[tuple[str, str]]:
    """Stop once `max_bytes` of text (counted as characters, cheaply) has been taken."""
    total = 0
    for key, text in docs:
        if max_bytes is not None and total >= max_bytes:
            return
        total += len(text)
        yield key, text


def _key_hash(key: str, secret: bytes = b"") -> int:
    digest = hmac.new(secret, key.encode(), "sha256").digest() if secret else hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big")


# ---- raw text: writing -------------------------------------------------------------------------------------

class _ShardWriter:
    """Streams one split's documents into parquet shards of at most RAW_SHARD_CHARS."""

    def __init__(self, folder: Path, split: str):
        self.folder, self.split = folder, split
        self.files: list[str] = []
        self.docs = self.chars = 0
        self._buf: list[str] = []
        self._buf_chars = 0
        self._writer: pq.ParquetWriter | None = None
        self._shard_chars = 0

    def add(self, text: str) -> None:
        self._buf.append(text)
        self._buf_chars += len(text)
        self.docs += 1
        self.chars += len(text)
        if len(self._buf) >= 4096 or self._buf_chars >= 32_000_000:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._writer is None or self._shard_chars >= RAW_SHARD_CHARS:
            self._close_writer()
            name = f"{self.split}_{len(self.files):05d}.parquet"
            self.files.append(name)
            self._writer = pq.ParquetWriter(self.folder / name, pa.schema([("text", pa.string())]))
            self._shard_chars = 0
        self._writer.write_table(pa.table({"text": pa.array(self._buf, pa.string())}))
        self._shard_chars += self._buf_chars
        self._buf, self._buf_chars = [], 0

    def _close_writer(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        self._flush()
        self._close_writer()


def _write_raw(ddir: Path, docs: Iterable[tuple[str, str]], *, source: str, params: dict, secret: bytes = b"",
               val_only=None, hidden: list[str] = ()) -> dict:
    """Split `docs` into train/val (by the keyed hash of each key, at least one of each; with `val_only`, only
    keys it accepts can be validation, VAL_TEST_FRACTION of them) and write them as parquet shards; then swap
    them in for the previous raw shards and write raw.json last. `hidden`: the folders validation comes from."""
    tmp = ddir / f".raw.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    writers = {"train": _ShardWriter(tmp, "train"), "val": _ShardWriter(tmp, "val")}
    digest = hashlib.sha256()
    # Hold back the train candidate with the lowest hash and the val candidate with the highest, so that a
    # corpus too small to get a validation document by hash still gets one (and likewise for training).
    held: dict[str, tuple[int, str, str] | None] = {"train": None, "val": None}
    readable = [not hidden]                  # True once a validation document is not from the hidden files
    fraction = VAL_TEST_FRACTION if val_only else VAL_FRACTION

    def emit(split: str, text: str, key: str) -> None:
        if split == "val" and val_only is not None and not val_only(key):
            readable[0] = True
        writers[split].add(text)
        digest.update(f"{split}\0{len(text)}\0".encode())
        digest.update(text.encode("utf-8", "replace"))

    try:
        for key, text in docs:
            if not text:
                continue
            h = _key_hash(key, secret)
            split = "val" if h < fraction * 2**64 and (val_only is None or val_only(key)) else "train"
            better = (lambda a, b: a < b) if split == "train" else (lambda a, b: a > b)
            prev = held[split]
            if prev is None or better(h, prev[0]):
                held[split] = (h, text, key)
                text, key = (prev[1], prev[2]) if prev else ("", key)
            if text:
                emit(split, text, key)
        n = writers["train"].docs + writers["val"].docs + sum(v is not None for v in held.values())
        if n < 2:
            raise DataError(f"the {source} corpus has {n} non-empty document(s); it needs at least 2 "
                            "(one for training, one for validation)")
        for split, other in (("train", "val"), ("val", "train")):
            if held[split] is not None:
                lacking = writers[other].docs == 0 and held[other] is None
                emit(other if lacking else split, held[split][1], held[split][2])
        for w in writers.values():
            w.close()
        old = _read_raw(ddir)
        (ddir / "raw.json").unlink(missing_ok=True)  # from here until the end the raw folder is not complete
        for f in (old or {}).get("train", []) + (old or {}).get("val", []):
            (ddir / f).unlink(missing_ok=True)
        for w in writers.values():
            for f in w.files:
                os.replace(tmp / f, ddir / f)
    finally:
        for w in writers.values():
            w._close_writer()
        shutil.rmtree(tmp, ignore_errors=True)
    raw = {"source": source, "params": params, "train": writers["train"].files, "val": writers["val"].files,
           "docs": {s: w.docs for s, w in writers.items()}, "chars": {s: w.chars for s, w in writers.items()},
           "sha256": digest.hexdigest(), "hidden": list(hidden), "val_readable": readable[0]}
    _write_json(ddir / "raw.json", raw)
    return raw


def _read_raw(ddir: Path) -> dict | None:
    try:
        return json.loads((ddir / "raw.json").read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- climbmix: shards --------------------------------------------------------------------------------------

def shard_name(i: int) -> str:
    return f"shard_{i:05d}.parquet"


def _climbmix_raw(ddir: Path, *, num_shards: int | None, base_url: str | None, val_shard: int | None,
                  workers: int, say: Progress) -> dict:
    n = CLIMBMIX_TRAIN_SHARDS if num_shards is None else num_shards
    val = CLIMBMIX_VAL_SHARD if val_shard is None else val_shard
    if n < 1:
        raise DataError(f"--shards {n}: need at least one training shard")
    if val < n:
        raise DataError(f"validation shard {val} is among the {n} training shards; use fewer --shards")
    base = (base_url or CLIMBMIX_BASE_URL).rstrip("/")
    train, vals = [shard_name(i) for i in range(n)], [shard_name(val)]
    todo = [f for f in train + vals if not (ddir / f).is_file()]
    if todo:
        say(f"downloading {len(todo)} of {n + 1} climbmix shards from {base}")
        download_all([(f"{base}/{f}", ddir / f) for f in todo], workers=workers, say=say)
    digest = hashlib.sha256()
    for f in train + vals:
        digest.update(f"{f}\0{(ddir / f).stat().st_size}\0".encode())
    raw = {"source": "climbmix", "params": {"base_url": base}, "train": train, "val": vals,
           "sha256": digest.hexdigest()}
    if _read_raw(ddir) != raw:
        _write_json(ddir / "raw.json", raw)
    return raw


# ---- tokenizing --------------------------------------------------------------------------------------------

def _tokenize(ddir: Path, raw: dict, *, vocab_size: int, name: str, say: Progress) -> Path:
    tok_dir = tokenized_dir(ddir, vocab_size)
    if _tok_problem(tok_dir) is None and load_meta(tok_dir).get("raw_sha256") == raw["sha256"]:
        say(f"{tok_dir} is already prepared from the same text")
        return tok_dir
    tmp = ddir / f".{tok_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        t0 = time.time()
        say(f"training a BPE tokenizer, vocab {vocab_size}")
        tok = Tokenizer.train(_sample(_texts(ddir, raw["train"]), TOKENIZER_SAMPLE_CHARS), vocab_size)
        tok.save(tmp)
        counts = {}
        for split in ("val", "train"):
            say(f"tokenizing {split}")
            counts[split] = _write_split(tok, _texts(ddir, raw[split]), tmp, split, say)
        meta = {"format": FORMAT, "dataset": name, "source": raw["source"], "vocab_size": vocab_size,
                "n_vocab": tok.vocab_size, "bos_id": tok.bos_id, "train": counts["train"], "val": counts["val"],
                "raw_sha256": raw["sha256"], "tokenizer_sha256": tok.sha256(),
                "seconds": round(time.time() - t0, 1), "created_at": time.time()}
        _write_json(tmp / "meta.json", meta)
        old = ddir / f".{tok_dir.name}.old-{os.getpid()}"
        if tok_dir.exists():
            os.replace(tok_dir, old)
        os.replace(tmp, tok_dir)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tok_dir


def _texts(ddir: Path, files: list[str]) -> Iterator[str]:
    for f in files:
        yield from parquet_texts(ddir / f)


def _sample(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    total = 0
    for t in texts:
        if total >= max_chars:
            return
        total += len(t)
        yield t


def _write_split(tok: Tokenizer, texts: Iterable[str], out: Path, split: str, say: Progress) -> dict:
    """Encode in batches and stream ids to `<split>.bin`; only the document lengths stay in memory. Encoding
    (parallel inside `tokenizers`, without the GIL) of one batch overlaps reading and writing of the others."""
    digest = hashlib.sha256()
    lengths: list[np.ndarray] = []
    ntok, last_say = 0, time.time()
    with open(out / f"{split}.bin", "wb") as f, ThreadPoolExecutor(1) as pool:
        def write(ids: list[list[int]]) -> None:
            nonlocal ntok, last_say
            flat: list[int] = []
            for x in ids:
                flat.append(tok.bos_id)
                flat.extend(x)
            b = np.array(flat, dtype=np.uint16).tobytes()
            f.write(b)
            digest.update(b)
            lengths.append(np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids)))
            ntok += len(flat)
            if time.time() - last_say > 10:
                say(f"tokenizing {split}: {ntok:,} tokens so far")
                last_say = time.time()

        pending = None
        for batch in _char_batches(texts, ENCODE_BATCH_CHARS):
            fut = pool.submit(tok.encode_batch, batch)
            if pending is not None:
                write(pending.result())
            pending = fut
        if pending is not None:
            write(pending.result())
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if lens.size == 0:
        raise DataError(f"the {split} split has no documents; check the data source")
    np.save(out / f"{split}.idx.npy", np.concatenate(([0], np.cumsum(lens))).astype(np.int64))
    return {"docs": int(lens.size), "tokens": ntok, "sha256": digest.hexdigest()}


def _char_batches(texts: Iterable[str], max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for t in texts:
        batch.append(t)
        chars += len(t)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch
