"""bench/gpu_decisions.sh's scripted agent: in the order of its own proposals (counted in $NEAR_NULL_STATE, not
by experiment number, which re-runs and calibration shift), the real improvement first (the HANDICAP line
removed), then six near-null edits of LR_MULT (factors of the LR_MULT train.py has), then small LR_MULT edits.
PLAN=null-first puts the nulls first."""
import os, re
from pathlib import Path
lrs = [1.005, 0.995, 1.01, 0.99, 1.02, 0.98]
plan = lrs + ["real"] if os.environ.get("PLAN") == "null-first" else ["real"] + lrs
state = Path(os.environ.get("NEAR_NULL_STATE", "/tmp/near-null-agent.count"))
k = int(state.read_text()) if state.exists() else 0
state.write_text(str(k + 1))
n = int(os.environ["AR_EXPERIMENT"])
p = Path("train.py"); s = p.read_text()
step = plan[k] if k < len(plan) else None
if step == "real":
    s = "\n".join(ln for ln in s.splitlines() if "# HANDICAP" not in ln) + "\n"
    what = "real: the handicap removed (15 % faster steps)"
else:
    factor = step if step is not None else round(1 + n / 1000, 3)
    now = float(re.search(r"^LR_MULT = ([0-9.]+)", s, flags=re.M).group(1))
    lr = round(now * factor, 6)
    s = re.sub(r"^LR_MULT = [0-9.]+", f"LR_MULT = {lr}", s, count=1, flags=re.M)
    what = f"near-null: LR_MULT {now} x {factor} = {lr}"
p.write_text(s)
Path(os.environ["AR_DESCRIPTION_FILE"]).write_text(what + "\n")
