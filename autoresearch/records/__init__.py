"""What a session leaves on disk and reads back: the ledger, queue, events, lock, tags, layout, and the
one way to write a file durably."""
