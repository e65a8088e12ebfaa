"""The dashboard in a real headless browser: Playwright driving the system's Chromium (Debian's `chromium`;
Playwright's own browser download is not reachable on these machines), a real `ar serve` process, a real
loop adding results while the page is open.

The page loads; the running experiment shows; a new result appears without a reload; a click opens its diff;
an agent's description full of HTML stays text. The screenshot goes to the test's folder, and also to
$AR_DASHBOARD_SCREENSHOT when set (docs/dashboard.png, shown in docs/dashboard.md, was taken that way). Skipped, saying
why, only where no Chromium is installed.
"""

from __future__ import annotations

import re

import os
import shutil
import threading

import pytest

from autoresearch.records.events import EventLog
from autoresearch.records.lock import RepoLock
from autoresearch.session.loop import Loop
from autoresearch.proposers import Proposal

from test_loop import _isolated, cfg, make_repo  # noqa: F401  (autouse fixture)
from test_serve import Served

pytestmark = pytest.mark.e2e

CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome")
XSS = '<img src=x onerror="window.pwned=1"><script>window.pwned=1</script> halve the batch'


def chromium() -> str | None:
    given = os.environ.get("AR_CHROMIUM")
    for c in ((given,) if given else CANDIDATES):
        path = c if os.path.isabs(c) and os.access(c, os.X_OK) else shutil.which(c)
        if path:
            return path
    return None


class Scripted:
    """Knob edits with descriptions of our choosing (one of them hostile HTML)."""

    name = "scripted"

    def __init__(self, plan):
        self.plan = list(plan)

    def propose(self, ctx):
        if not self.plan:
            return None
        knobs, description = self.plan.pop(0)
        return Proposal(description, knobs=knobs)


@pytest.mark.slow
def test_dashboard_in_a_headless_browser(tmp_path):
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium on this machine: install the Debian package `chromium` (apt-get install -y "
                    "chromium) or point AR_CHROMIUM at a Chromium binary")
    from playwright.sync_api import expect, sync_playwright

    root = make_repo(tmp_path)
    c = cfg(time_budget=1.0, noise=0.01)
    Loop(c, root, "t", Scripted([({"TOTAL_BATCH_SIZE": 2**18}, XSS)])).run(max_experiments=2)
    server = Served("--repo", str(root), "--tag", "t", "--noise", "0.01", cwd=tmp_path)
    more = Scripted([({"TOTAL_BATCH_SIZE": 2**17}, "halve the batch again"), ({"WARMDOWN_RATIO": 0.4}, "shorter "
                     "warmdown"), ({"LR_MULT": 1.5}, "raise the LR")])
    loop = threading.Thread(target=lambda: Loop(c, root, "t", more).run(max_experiments=3))
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(server.url)
            rows = page.locator("#results tbody tr")
            expect(rows).to_have_count(2)
            expect(page.locator("#tag")).to_have_text("t")
            expect(page.locator("#conn")).to_have_text("live")
            # the hostile description is text: no element, no script ran
            expect(page.locator('#results tbody tr[data-exp="2"] td.desc')).to_contain_text("<img src=x")
            assert page.locator("#results img, #results script").count() == 0

            page.evaluate("window.loadedOnce = true")           # gone if the page reloads
            loop.start()
            expect(page.locator("#now-body")).to_contain_text("training", timeout=30_000)
            expect(rows).to_have_count(5, timeout=60_000)        # pushed, not polled by the page
            assert page.evaluate("window.loadedOnce") is True
            expect(page.locator("#results tbody tr").first).to_contain_text("raise the LR")
            expect(page.locator("#best")).to_have_text(page.locator("#results tbody tr", has_text="halve the batch "
                                                                     "again").locator("td").nth(3).inner_text())
            loop.join(timeout=60)
            expect(page.locator("#state")).to_have_text("stopped")

            page.locator('#results tbody tr[data-exp="3"]').click()
            expect(page.locator("#diff-panel")).to_be_visible()
            expect(page.locator("#diff")).to_contain_text("+TOTAL_BATCH_SIZE = 2**17")
            expect(page.locator("#diff .add")).not_to_have_count(0)
            expect(page.locator("#journal")).to_contain_text(      # the stand-in's score at the bowl's floor, again
                re.compile(r"0004 \d\.\d{6} \(\+0\.000000\): WARMDOWN_RATIO 0\.5 -> 0\.4"))
            expect(page.locator("#journal")).to_contain_text("LR_MULT up: 0005")

            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("AR_DASHBOARD_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["AR_DASHBOARD_SCREENSHOT"])
            assert page.evaluate("window.pwned === undefined") and dialogs == []
            # several slots (the events `ar run --gpus 0,1` writes, under its lock): one line per slot, pushed
            with RepoLock(root / "runs" / ".ar.lock", tag="t", command="ar run --gpus 0,1"):
                log = EventLog(root / "runs" / "t" / "events.jsonl")
                log.session_started(tag="t", branch="autoresearch/t", by_slot=True, slots=[
                    {"slot": 0, "label": "gpu0", "gpu": 0, "kind": "gpu"},
                    {"slot": 1, "label": "gpu1", "gpu": 1, "kind": "gpu"}])
                log.write("experiment_started", exp_id=6, kind="propose", slot=0, description="wider MLP")
                log.write("phase", exp_id=6, phase="training")
                log.write("step", exp_id=6, step=40, pct=50.0, loss=3.2, tokens_per_s=1e5, mfu=41.0, dt_ms=10,
                          remaining_s=9)
                expect(page.locator("#slots tbody tr")).to_have_count(2)
                expect(page.locator("#slots tbody tr").first).to_contain_text("0006 wider MLP")
                expect(page.locator("#slots tbody tr").nth(1)).to_contain_text("idle")
                expect(page.locator("#state")).to_have_text("running")
            expect(page.locator("#state")).to_have_text("stopped")      # the lock is free and no stop came: killed
            browser.close()
    finally:
        loop.join(timeout=120)
        server.stop()
