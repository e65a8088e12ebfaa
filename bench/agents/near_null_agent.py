"""bench/gpu_decisions.sh's scripted agent: by experiment number, the real improvement first (the HANDICAP line
removed), then six near-null edits of LR_MULT, then small LR_MULT edits. PLAN=null-first puts the nulls first."""
import os, re
from pathlib import Path
lrs = [1.005, 0.995, 1.01, 0.99, 1.02, 0.98]
first = 4 if os.environ.get("PLAN") == "null-first" else 5      # experiment 4 is the real one unless null-first
plan = {first + i: v for i, v in enumerate(lrs)}
n = int(os.environ["AR_EXPERIMENT"])
p = Path("train.py"); s = p.read_text()
if n in plan:
    s = re.sub(r"^LR_MULT = [0-9.]+", f"LR_MULT = {plan[n]}", s, count=1, flags=re.M)
    what = f"near-null: LR_MULT {plan[n]}"
elif "# HANDICAP" in s:
    s = "\n".join(ln for ln in s.splitlines() if "# HANDICAP" not in ln) + "\n"
    what = "real: the handicap removed (15 % faster steps)"
else:
    s = re.sub(r"^LR_MULT = [0-9.]+", f"LR_MULT = {1 + n / 1000:.3f}", s, count=1, flags=re.M)
    what = f"near-null: LR_MULT {1 + n / 1000:.3f}"
p.write_text(s)
Path(os.environ["AR_DESCRIPTION_FILE"]).write_text(what + "\n")
