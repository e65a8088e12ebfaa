"""The fixed harness: what an experiment may never change. train.py imports it; it imports nothing of the runner."""
