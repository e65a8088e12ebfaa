"""Sweeps: the sweep file, its points and dry-run plan (file.py); running them through the Loop, with early
stopping, successive halving and --validate-top (run.py). The statistics a sweep and the report share are
records/rows.py's."""
