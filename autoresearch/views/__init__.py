"""What people read: the report and its plots, `ar status`, the dashboard, `ar doctor` and its probe. Views
read records (the ledger, the events, records/rows.py), never the engine: no view imports sweep/, session/,
the session or the executors (tests/test_structure.py holds it)."""
