"""HTTP downloads of parquet shards: parallel, resumable, retried, checked before they are renamed into place.

`download(url, dest)` fetches through `dest.part`: a partial file is resumed with an HTTP Range request;
5xx, 429, dropped connections and truncated or unreadable bodies are retried with exponential backoff
(RETRIES attempts after the first, BACKOFF_S doubling); a 404 or another 4xx fails at once. The file is renamed
to `dest` only once its parquet footer reads and it has a `text` column. A host that never answered at all
is reported as the network being unreachable.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.parquet as pq
import requests

from .errors import DataError

RETRIES = 5                                  # download attempts after the first
BACKOFF_S = 1.0                              # first retry delay; doubles each attempt
TIMEOUT_S = 60.0

Progress = Callable[[str], None]


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class _Retry(Exception):
    """A failure worth another attempt: 5xx, 429, a dropped connection, a truncated or unreadable body."""


def download_all(jobs: list[tuple[str, Path]], *, workers: int = 8, say: Progress | None = None) -> None:
    """Download (url, dest) pairs in parallel; the first failure stops the others and is raised."""
    stop = threading.Event()
    done = 0
    with ThreadPoolExecutor(max(1, min(workers, len(jobs)))) as pool:  # a Session per download: not thread-safe
        futures = [pool.submit(download, url, dest, stop=stop) for url, dest in jobs]
        try:
            for fut in as_completed(futures):
                fut.result()
                done += 1
                if say:
                    say(f"downloaded {done}/{len(jobs)}")
        except BaseException:
            stop.set()
            for f in futures:
                f.cancel()
            raise


def download(url: str, dest: Path, *, session: requests.Session | None = None,
             stop: threading.Event | None = None) -> None:
    """Fetch `url` to `dest` through `dest.part`: resumes a partial file with an HTTP Range request, retries
    5xx/429/connection errors/truncated bodies with exponential backoff, checks the parquet footer, then
    renames into place."""
    if dest.is_file():
        return
    own = session is None
    session = session or requests.Session()
    part = dest.with_name(dest.name + ".part")
    answered = [False]  # did the host ever answer? if not, we are probably offline
    last: BaseException | None = None
    try:
        for attempt in range(RETRIES + 1):
            if stop is not None and stop.is_set():
                raise DataError(f"download of {url} stopped after another download failed")
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                _fetch_once(session, url, part, answered)
                _check_download(part)
                os.replace(part, dest)
                return
            except (_Retry, requests.RequestException) as e:  # RequestException: refused, timed out, cut off
                last = e
    finally:
        if own:
            session.close()
    if not answered[0]:
        raise DataError(f"cannot reach {urlparse(url).netloc}: the network is unreachable ({one_line(last)}); "
                        "`ar prepare builtin` works offline")
    raise DataError(f"download of {url} failed after {RETRIES + 1} attempts ({one_line(last)}); "
                    "run the same command again to resume")


def _fetch_once(session: requests.Session, url: str, part: Path, answered: list[bool]) -> None:
    have = part.stat().st_size if part.is_file() else 0
    headers = {"Accept-Encoding": "identity"}
    if have:
        headers["Range"] = f"bytes={have}-"
    with session.get(url, headers=headers, stream=True, timeout=TIMEOUT_S) as r:
        answered[0] = True
        code = r.status_code
        if code == 404:
            raise DataError(f"{url} does not exist (HTTP 404); check --base-url and --shards")
        if code == 416:  # our partial file is not a prefix the server knows: start over
            part.unlink(missing_ok=True)
            raise _Retry("HTTP 416 for a resumed download")
        if code == 429 or code >= 500:
            raise _Retry(f"HTTP {code} {r.reason}")
        if code >= 400:
            raise DataError(f"{url}: HTTP {code} {r.reason}; check the URL and your access to it")
        length = r.headers.get("Content-Length")
        if code == 206 and _range_start(r.headers.get("Content-Range")) == have:
            mode, expected = "ab", have + int(length) if length else None
        else:  # the server ignored or mangled the Range: take the whole body
            mode, expected = "wb", int(length) if length else None
        with open(part, mode) as f:
            for chunk in r.iter_content(1 << 16):  # small: a cut-off read loses at most one chunk
                f.write(chunk)
    size = part.stat().st_size
    if expected is not None and size != expected:
        raise _Retry(f"truncated body: {size} of {expected} bytes")


def _range_start(content_range: str | None) -> int | None:
    try:  # "bytes 100-999/1000"
        return int(content_range.split()[1].split("-")[0])  # type: ignore[union-attr]
    except (AttributeError, IndexError, ValueError):
        return None


def _check_download(part: Path) -> None:
    try:
        names = pq.ParquetFile(part).schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        part.unlink(missing_ok=True)
        raise _Retry(f"downloaded file is not a readable parquet file ({one_line(e)})") from None
    if "text" not in names:
        raise DataError(f"downloaded {part.name[:-5]} has no `text` column; check --base-url")
