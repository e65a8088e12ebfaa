"""Edit a workspace's train.py for the decision benches: TOTAL_BATCH_SIZE set, and optionally each step made 15 %
slower (a sleep of 15 % of the step's own time: the same arithmetic, fewer steps) and LR_MULT set.

    python handicap.py SOURCE DEST --batch '2**17' [--slow] [--lr-mult 0.99]
"""

import argparse
import re
from pathlib import Path


def edit(text: str, batch: str, slow: bool, lr_mult: str | None) -> str:
    text, n = re.subn(r"^TOTAL_BATCH_SIZE = \S+", f"TOTAL_BATCH_SIZE = {batch}", text, count=1, flags=re.M)
    assert n == 1, "train.py has no TOTAL_BATCH_SIZE knob"
    if slow:
        step_end = "            dt = time.time() - t0\n"
        assert text.count(step_end) == 1, "train.py's step timing line moved"
        text = text.replace(step_end, "            time.sleep(0.15 * (time.time() - t0))           "
                                      "# HANDICAP: 15 % slower steps\n" + step_end)
    if lr_mult is not None:
        text, n = re.subn(r"^LR_MULT = \S+", f"LR_MULT = {lr_mult}", text, count=1, flags=re.M)
        assert n == 1, "train.py has no LR_MULT knob"
    return text


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("source", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--lr-mult")
    a = ap.parse_args()
    a.dest.write_text(edit(a.source.read_text(), a.batch, a.slow, a.lr_mult))
