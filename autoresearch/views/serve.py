"""`ar serve`: a read-only live dashboard of one tag (or any results.tsv), pushed to the browser over SSE.

The page (resources/dashboard.html + dashboard.js, no build step) loads `/api/state` once, then listens on
`/api/events`: `status` events carry the fold of events.jsonl (events.py: the session, the running experiment,
its last step, the slots) when it changes; `results` events carry the ledger rows, the best-so-far curve and
the journal when results.tsv changes. The server looks at two files' size and mtime twice a second, once for
all browsers (a change is read once and fanned out), so a dozen open tabs cost what one does. While the fold
says a session runs, the same watcher asks the repo lock whether it still does: a loop killed with kill -9
writes no stop, and the page must not show it running.

Safety: only GET; bound to 127.0.0.1 unless --host says otherwise, and then every request needs the token
(`?token=` once, which sets a cookie, or `Authorization: Bearer`); on loopback the Host header must name
the loopback (no DNS rebinding). Text from the records — descriptions above all, which an agent writes —
is sent as JSON and put into the page with textContent only, under a Content-Security-Policy without
inline script.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from autoresearch.proposers import memory
from autoresearch.errors import ArError, ConfigError
from autoresearch.records.events import against_lock, fold
from autoresearch.records.events import read as read_events
from autoresearch.gitops import GitRepo
from autoresearch.records.layout import TagLayout
from autoresearch.records.ledger import read_results
from autoresearch.records.lock import read_holder
from autoresearch import objective

RESOURCES = Path(__file__).parent.parent / "resources"
POLL_S = 0.5
KEEPALIVE_S = 15.0
DIFF_MAX = 200_000
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")
_PAGES = {"/": ("dashboard.html", "text/html; charset=utf-8"),
          "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8")}
_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                       "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                       "form-action 'none'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


@dataclass
class Source:
    """What the dashboard shows: a tag folder under runs/, or a results file of its own."""

    results: Path
    tag_dir: Path | None          # None: a results file outside runs/ (upstream's)
    repo: Path | None
    noise: float | None = None
    choice: object = None         # how the tag was chosen (tags.Choice), None for --tag or --results

    @property
    def events(self) -> Path | None:
        return TagLayout(self.tag_dir).events if self.tag_dir else None

    def name(self) -> str:
        return self.tag_dir.name if self.tag_dir else self.results.name


def source_for(repo: Path, tag: str | None, results: Path | None, noise: float | None = None) -> Source:
    """Resolve --tag / --results like `ar journal` (tags.py's rule by default)."""
    j, tag_dir, choice = memory.for_repo(repo, tag, results, noise)     # the same checks and one-line errors
    path = Path(j.source)
    git_ok = (Path(repo) / ".git").exists()
    return Source(path, tag_dir, Path(repo) if git_ok else None, noise, choice)


def _stamp(path: Path | None) -> tuple[int, int] | None:
    try:
        st = path.stat() if path else None
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns) if st else None


def read_status(src: Source) -> dict:
    """The fold of the tag's events ({} for a results file outside runs/)."""
    return fold(read_events(src.events)) if src.events else {}


def alive(src: Source, state: dict) -> dict:
    """`state` checked against the repo lock (only while it says a session runs: a stopped one stays stopped)."""
    if state.get("state") != "running" or src.tag_dir is None:
        return state
    lock = TagLayout(src.tag_dir).lock
    return against_lock(state, read_holder(lock) if lock.exists() else None)


def read_results_state(src: Source) -> dict:
    """The ledger rows, the best-so-far curve and the journal: all from the records."""
    rows = read_results(src.results, warn=lambda m: None)
    j = memory.load(src.tag_dir, results=None if src.tag_dir else src.results, repo=src.repo, noise=src.noise)
    obj = objective.load(src.tag_dir) if src.tag_dir else objective.DEFAULT
    out, curve, best = [], [], None
    for i, r in enumerate(rows):
        d = r.to_dict()
        d["exp_id"] = r.exp_id if r.exp_id is not None else i + 1
        d["description"] = memory.clean_text(r.description, 300)
        d["reason"] = memory.clean_text(r.reason, 600)
        out.append(d)
        if r.status.value == "keep" and r.val_bpb is not None and obj.better(r.val_bpb, best):
            best = r.val_bpb
        if r.val_bpb is not None:
            curve.append({"exp_id": d["exp_id"], "val_bpb": r.val_bpb, "best": best, "status": r.status.value})
    return {"rows": out, "curve": curve, "journal": j.to_dict(), "objective": obj.describe()}


def read_diff(src: Source, exp_id: int) -> str:
    rows = read_results(src.results, warn=lambda m: None)
    for i, r in enumerate(rows):
        if (r.exp_id if r.exp_id is not None else i + 1) != exp_id:
            continue
        if src.tag_dir is not None:
            text = memory.recorded_change(TagLayout(src.tag_dir), r)
            if text:
                return text[:DIFF_MAX]
        if src.repo is not None and r.commit and r.exp_id is None:    # upstream's rows: the commit's own diff
            try:
                return GitRepo(src.repo)._git("show", "--format=", "--no-color", r.commit)[:DIFF_MAX]
            except ArError:
                pass
        return ""
    raise KeyError(exp_id)


class Hub:
    """One watcher for every browser: it checks the files' stamps, reads a change once, and fans it out."""

    def __init__(self, src: Source):
        self.src = src
        self.version = 0
        self.closing = False                           # set on Ctrl-C: open streams end, the server stops
        self.events: dict[str, tuple[int, str]] = {}   # kind -> (version, JSON) of the latest change
        self._cond: asyncio.Condition | None = None
        self._stamps: dict[str, tuple[int, int] | None] = {}
        self._fold: dict = {}                          # the events' fold, before the lock check
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._cond = asyncio.Condition()
        self.check()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()

    def check(self) -> bool:
        changed = False
        for kind, path in (("status", self.src.events), ("results", self.src.results)):
            stamp = _stamp(path)
            fresh = kind not in self._stamps or stamp != self._stamps[kind]
            self._stamps[kind] = stamp
            if kind == "status":
                if fresh:
                    self._fold = read_status(self.src)
                doc = alive(self.src, self._fold)     # asked at every look: a kill -9 changes no file
            elif fresh:
                try:
                    doc = read_results_state(self.src)
                except ArError as e:
                    doc = {"error": str(e)}
            else:
                continue
            text = json.dumps(doc, default=str)
            if kind in self.events and self.events[kind][1] == text:
                continue
            self.version += 1
            self.events[kind] = (self.version, text)
            changed = True
        return changed

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if await asyncio.to_thread(self.check):
                async with self._cond:
                    self._cond.notify_all()

    async def wait(self, seen: int, timeout: float) -> None:
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(lambda: self.version > seen), timeout)
            except asyncio.TimeoutError:
                pass

    def state(self) -> str:
        parts = {k: json.loads(v) for k, (_, v) in self.events.items()}
        return json.dumps({"name": self.src.name(), "source": str(self.src.results),
                           "status": parts.get("status", {}), **parts.get("results", {})}, default=str)


def _is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_app(src: Source, *, token: str | None, loopback: bool):
    """The Starlette application (GET only)."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    hub = Hub(src)

    def guard(request) -> Response | None:
        if loopback:
            host = request.headers.get("host", "")
            name = host[:host.find("]") + 1] if host.startswith("[") else host.split(":")[0]
            if name not in LOOPBACK_NAMES:
                return PlainTextResponse("forbidden: this dashboard answers to localhost only\n", 403)
        if token is None:
            return None
        given = (request.query_params.get("token") or request.cookies.get("ar_token") or
                 request.headers.get("authorization", "").removeprefix("Bearer ").strip())
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            return PlainTextResponse("unauthorized: open the URL with ?token=… that `ar serve` printed\n", 401)
        return None

    def secured(handler):
        async def endpoint(request):
            refused = guard(request)
            if refused is not None:
                return refused
            response = await handler(request)
            response.headers.update(_HEADERS)
            if token is not None and request.query_params.get("token"):
                response.set_cookie("ar_token", token, httponly=True, samesite="strict")
            return response
        return endpoint

    async def page(request):
        name, kind = _PAGES[request.url.path]
        return Response((RESOURCES / name).read_text(), media_type=kind)

    async def state(request):
        return Response(hub.state(), media_type="application/json")

    async def diff(request):
        try:
            exp_id = int(request.path_params["exp_id"])
            return PlainTextResponse(await asyncio.to_thread(read_diff, src, exp_id))
        except (KeyError, ValueError):
            return PlainTextResponse("no such experiment\n", 404)

    async def events(request):
        async def stream():
            seen: dict[str, int] = {}        # a new stream gets the current state first: nothing is missed
            yield "retry: 2000\n\n"
            quiet_since = time.monotonic()
            while not hub.closing and not await request.is_disconnected():
                for kind, (version, doc) in list(hub.events.items()):
                    if seen.get(kind) != version:
                        seen[kind] = version
                        quiet_since = time.monotonic()
                        yield f"event: {kind}\ndata: {doc}\n\n"
                await hub.wait(hub.version, 1.0)      # woken by a change; at least once a second for a stop
                if time.monotonic() - quiet_since > KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"X-Accel-Buffering": "no"})

    routes = [Route(p, secured(page), methods=["GET"]) for p in _PAGES] + [
        Route("/api/state", secured(state), methods=["GET"]),
        Route("/api/diff/{exp_id}", secured(diff), methods=["GET"]),
        Route("/api/events", secured(events), methods=["GET"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        hub.start()
        yield
        hub.stop()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.hub = hub
    return app


def check_host(host: str, token: str | None) -> tuple[bool, str | None]:
    """(bound to loopback, the token to require). Anything beyond loopback always needs a token."""
    loopback = _is_loopback(host)
    if not loopback and token is None:
        token = secrets.token_urlsafe(18)
    if token is not None and len(token) < 12:
        raise ConfigError("--token must be at least 12 characters; leave it out to get a random one")
    return loopback, token


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None
    sock.listen(64)
    return sock


def serve(src: Source, host: str, port: int, token: str | None, on_ready) -> None:
    """Run until Ctrl-C. `on_ready(url)` is called once the socket listens (port 0: a free one)."""
    try:
        import uvicorn
        import starlette  # noqa: F401
    except ImportError:
        raise ArError("ar serve needs starlette and uvicorn (dependencies of the package): "
                      "pip install starlette uvicorn") from None
    loopback, token = check_host(host, token)
    sock = bind(host, port)
    app = make_app(src, token=token, loopback=loopback)
    shown = "127.0.0.1" if loopback and host != "localhost" else host
    real_port = sock.getsockname()[1]
    url = f"http://{'[' + shown + ']' if ':' in shown else shown}:{real_port}/" + (f"?token={token}" if token else "")
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.hub.closing = True       # the event streams end within a second, then uvicorn stops
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                   timeout_graceful_shutdown=5))
    on_ready(url)
    server.run(sockets=[sock])
