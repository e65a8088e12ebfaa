"""ar's training feed (harness/feed.py) on a clock the test moves: the first batch opens the window, the window is
the budget less what the start-up costs, and nothing is served from its end on. The client is the run's end of
the socket, here in the same process; nothing waits for the window to pass."""

from __future__ import annotations

import numpy as np
import pytest

from autoresearch.harness.feed import Feed, FeedClient

from fixtures.clocks import ManualClock


@pytest.fixture
def feed_and_client(tiny_dataset):
    made = []

    def make(budget: float, charge: float = 0.0):
        clock = ManualClock(wall=2_000_000.0)
        feed = Feed(tiny_dataset.tok_dir, seed=42, budget=budget, on_open=lambda: charge, clock=clock)
        client = FeedClient(feed.child_fd)
        feed.child_fd = None               # the client owns that end now
        made.append((feed, client))
        return feed, client, clock

    yield make
    for feed, client in made:
        client.close()
        feed.close()


@pytest.mark.parametrize("budget, charge, served_at, closed_at", [
    (10.0, 0.0, [0.0, 5.0, 9.99], 10.0),      # the window is the budget from the first batch
    (10.0, 3.0, [0.0, 6.99], 7.0),            # a start-up charge of 3 s ends it 3 s sooner
    (10.0, 15.0, [], 0.0),                    # a charge past the budget: nothing at all is served
])
def test_the_window_opens_at_the_first_batch_and_serves_nothing_from_its_end(feed_and_client, budget, charge,
                                                                               served_at, closed_at):
    feed, client, clock = feed_and_client(budget, charge)
    clock.advance(42.0)                       # start-up before the first batch is not in the window
    opened = clock.time()
    for t in served_at:
        clock.advance(opened + t - clock.time())
        got = client.fetch(2, 65)
        assert got is not None, t
        rows, epoch = got
        assert rows.shape == (2, 65) and rows.dtype == np.dtype("<u2") and epoch >= 0
    clock.advance(opened + closed_at - clock.time())
    assert client.fetch(2, 65) is None
    assert client.fetch(2, 65) is None                     # and never again
    assert feed.opened_at == opened and feed.deadline == pytest.approx(opened + budget - charge)
    assert feed.batches == len(served_at) and feed.refused == 2       # each ask past the end refused
    assert client.deadline == pytest.approx(opened + budget - charge) and client.window_start == opened


def test_a_broken_request_ends_the_feed(feed_and_client):
    feed, client, _ = feed_and_client(10.0)
    assert client.fetch(0, 65) is None                      # zero rows: the feed hangs up
    assert client.fetch(2, 65) is None
    assert feed.batches == 0


def test_the_same_seed_serves_the_same_rows(feed_and_client):
    (_, a, _), (_, b, _) = feed_and_client(10.0), feed_and_client(10.0)
    assert all(np.array_equal(a.fetch(4, 33)[0], b.fetch(4, 33)[0]) for _ in range(3))


@pytest.mark.parametrize("allowed", [True, False])
def test_a_head_started_runs_first_batch_waits_for_its_turn_and_the_window_opens_after(tiny_dataset, allowed):
    """experiment/headstart.py: `before_open` holds the first request (the turn is still the other run's); the
    window opens when it returns, at the clock's time then, not at the request's. False (the session stops): the
    run is told the feed has ended and nothing is served."""
    clock = ManualClock(wall=2_000_000.0)
    asked: list[float] = []

    def wait_for_turn():
        asked.append(clock.time())
        clock.advance(7.0)                    # the other run's last seconds, its finish and exit
        return allowed

    feed = Feed(tiny_dataset.tok_dir, seed=42, budget=10.0, on_open=lambda: 0.0, before_open=wait_for_turn,
                clock=clock)
    client = FeedClient(feed.child_fd)
    feed.child_fd = None
    try:
        start = clock.time()
        got = client.fetch(2, 65)
        if allowed:
            assert got is not None and feed.opened_at == start + 7.0
            assert feed.deadline == pytest.approx(start + 17.0)
            assert client.fetch(2, 65) is not None and asked == [start]     # asked once, at the first batch only
        else:
            assert got is None and feed.opened_at is None and asked == [start]
    finally:
        client.close()
        feed.close()


def test_the_window_beside_a_head_start_is_lengthened_by_what_that_start_up_used(tiny_dataset):
    """experiment/headstart.py: the neighbour that started early has used `lent` GPU seconds so far; this window
    gets them back at its end. Read every EXTENSION_EVERY seconds, never shortened, at most the cap."""
    from autoresearch.harness.feed import EXTENSION_EVERY
    clock = ManualClock(wall=3_000_000.0)
    lent = [0.0]
    feed = Feed(tiny_dataset.tok_dir, seed=42, budget=10.0, on_open=lambda: 1.0, extension=lambda: lent[0],
                extension_cap=5.0, clock=clock)
    client = FeedClient(feed.child_fd)
    feed.child_fd = None
    try:
        opened = clock.time()
        assert client.fetch(2, 65) is not None and client.deadline == pytest.approx(opened + 9.0)
        for at, used, deadline in [(8.0, 0.3, 9.3),        # an honest warm-up's GPU seconds
                                   (8.0 + EXTENSION_EVERY / 2, 2.0, 9.3),   # not read again so soon
                                   (8.5, 2.0, 11.0),
                                   (9.0, 1.0, 11.0),       # a reading that falls takes nothing back
                                   (10.0, 9.0, 14.0)]:     # at most the cap (the lead's)
            clock.advance(opened + at - clock.time())
            lent[0] = used
            assert client.fetch(2, 65) is not None, at
            assert client.deadline == pytest.approx(opened + deadline), at
        clock.advance(opened + 14.0 - clock.time())
        assert client.fetch(2, 65) is None and feed.extended == 5.0
    finally:
        client.close()
        feed.close()
