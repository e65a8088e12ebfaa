"""bench/gpu_decisions.sh's scripted agent: by experiment number, six near-null edits of LR_MULT (4-9), then
the real improvement (the HANDICAP line removed), then small LR_MULT edits."""
import os, re
from pathlib import Path
plan = {4: 1.005, 5: 0.995, 6: 1.01, 7: 0.99, 8: 1.02, 9: 0.98}
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
