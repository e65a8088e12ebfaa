"""A scripted agent whose move depends only on the experiment number (so a re-run after a kill repeats it):
improve (DEPTH - 1, kept), worse (LR_MULT 3, discarded), NaN (crash), a protected edit (rejected)."""
import os
import re
from pathlib import Path

exp = int(os.environ.get("AR_EXPERIMENT", "0"))
move = ("improve", "worse", "nan", "protected", "improve")[exp % 5]
p = Path("train.py")
text = p.read_text()
print(f"experiment {exp}: {move}", flush=True)
if move == "improve":
    depth = int(re.search(r"^DEPTH = (\d+)", text, re.M).group(1))
    text = re.sub(r"^DEPTH = \d+", f"DEPTH = {depth - 1}", text, count=1, flags=re.M)
elif move == "worse":
    text = re.sub(r"^LR_MULT = [^ ]+", "LR_MULT = 3.0", text, count=1, flags=re.M)
elif move == "nan":
    text = re.sub(r'^FAIL_MODE = "[a-z_]+"', 'FAIL_MODE = "nan"', text, count=1, flags=re.M)
else:
    Path("program.md").write_text("# program\nAnything goes.\n")
p.write_text(text)
print(f"{move} (experiment {exp})", flush=True)
