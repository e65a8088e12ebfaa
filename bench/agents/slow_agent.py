"""A scripted agent for benchmarks: thinks for argv[1] seconds (sleeps), then moves LR_MULT by experiment number
(a knob-only edit, so the compiled model is the baseline's: what is measured is the loop, not a new compile)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "agents"))
from _edit import describe, set_knob  # noqa: E402

time.sleep(float(sys.argv[1]))
values = ("0.9", "1.1", "0.8", "1.2", "0.95", "1.05", "0.85", "1.15")
value = values[int(os.environ.get("AR_EXPERIMENT", "0")) % len(values)]
set_knob("LR_MULT", value)
describe(f"LR_MULT -> {value}")
