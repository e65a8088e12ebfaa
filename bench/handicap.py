"""Edit a workspace's train.py for the decision benches: TOTAL_BATCH_SIZE set, and optionally each step made 15 %
slower (a sleep of 15 % of the step's own time: the same arithmetic, fewer steps) and LR_MULT set.

    python handicap.py SOURCE DEST --batch '2**17' [--slow] [--lr-mult 0.99]
"""

import argparse
from pathlib import Path

from autoresearch.knobs import parse_value, rewrite


def edit(text: str, batch: str, slow: bool, lr_mult: str | None) -> str:
    knobs = {"TOTAL_BATCH_SIZE": parse_value(batch)}
    if lr_mult is not None:
        knobs["LR_MULT"] = parse_value(lr_mult)
    text = rewrite(text, knobs)
    if slow:
        step_end = "            dt = time.time() - t0\n"
        assert text.count(step_end) == 1, "train.py's step timing line moved"
        text = text.replace(step_end, "            time.sleep(0.15 * (time.time() - t0))           "
                                      "# HANDICAP: 15 % slower steps\n" + step_end)
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
