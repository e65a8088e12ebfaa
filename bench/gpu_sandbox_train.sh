#!/usr/bin/env bash
# One sandboxed train.py run on the GPU host, the way ar starts it, to read its log (a diagnostic).
set -uo pipefail
export PYTHONUNBUFFERED=1 AR_CACHE=/tmp/arcache
source bench/gpu_setup.sh          # the carried wheels and this package; machine, python, torch
python3 -m autoresearch prepare builtin-site --vocab-size 8192 --max-bytes 60000000 2>&1 | tail -1
python3 - <<'PY'
import json, os, subprocess, sys, tempfile
from pathlib import Path
from autoresearch.harness import sandbox
from autoresearch.harness.data import check_prepared, train_view
tok = check_prepared(Path("/tmp/arcache"), "builtin-site", 8192)
w = Path(tempfile.mkdtemp()); (w / "ck").mkdir(); (w / "s").mkdir()
files = train_view(tok, w / "data")
p = sandbox.base_policy(); p["read"] += [str(w / "data"), *map(str, files), str(Path.cwd())]; p["write"] += [str(w / "ck"), str(w / "s")]
(w / "p.json").write_text(json.dumps(p))
env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG")}
env.update(HOME=str(w / "s"), TMPDIR=str(w / "s"), TORCHINDUCTOR_CACHE_DIR=str(w / "s/i"), TRITON_CACHE_DIR=str(w / "s/t"),
           AR_TIME_BUDGET="5", AR_PROFILE="gpu", AR_DATASET="builtin-site", AR_CACHE="/tmp/arcache", AR_TOK_DIR=str(w / "data"),
           AR_CHECKPOINT_DIR=str(w / "ck"), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1", TORCHINDUCTOR_COMPILE_THREADS="1")
r = subprocess.run([sys.executable, "-I", "-B", "-m", "autoresearch.harness.sandbox", str(w / "p.json"), "--", sys.executable, "train.py"],
                   env=env, capture_output=True, text=True, timeout=150)
print("rc", r.returncode); print(r.stdout[-1500:]); print(r.stderr[-2500:]); print("checkpoint:", sorted(os.listdir(w / "ck")))
PY
