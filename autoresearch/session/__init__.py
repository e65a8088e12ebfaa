"""A session: one tag's loop, its scheduler and slots, its limits, hooks and `ar try`."""
