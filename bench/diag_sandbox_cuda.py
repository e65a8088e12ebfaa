"""Which part of the sandbox stops CUDA from starting on this host (run on the GPU host; not a test).
Each variant restricts a fresh process, then initialises CUDA and allocates; prints ok or the error."""

import ctypes
import json
import os
import subprocess
import sys

CANDIDATES = ["/proc/self", "/proc"]
VARIANTS = {"none": None, "base-policy": dict(rules="base", extra=None)}
VARIANTS.update({f"base+write:{c}": dict(rules="base", extra=c) for c in CANDIDATES})

CHILD = r'''
import json, os, sys, ctypes
v = json.loads(sys.argv[1])
from autoresearch.harness import sandbox as sb
if v == "fork":
    import torch
    pid = os.fork()
    if pid:
        _, st = os.waitpid(pid, 0); sys.exit(os.waitstatus_to_exitcode(st))
elif v is not None:
    libc = ctypes.CDLL(None, use_errno=True)
    abi = sb.abi_version()
    handled = sb._handled_fs(abi)
    scoped = sb.SCOPE_ABSTRACT_UNIX | sb.SCOPE_SIGNAL
    net = sb.NET_BIND_TCP | sb.NET_CONNECT_TCP
    attr = (ctypes.c_uint64 * 3)(handled, net, scoped)
    fd = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(24), ctypes.c_uint32(0))
    assert fd >= 0, os.strerror(ctypes.get_errno())
    pol = sb.base_policy()
    if v["rules"] == "root":
        sb._add_path(libc, fd, "/", handled)
    else:
        for p in pol["read"]: sb._add_path(libc, fd, p, sb.READ & handled)
        for p in pol["write"]: sb._add_path(libc, fd, p, handled)
        if v["extra"]: sb._add_path(libc, fd, f"/proc/{os.getpid()}" if v["extra"] == "/proc/self" else v["extra"], handled)
    libc.prctl(38, 1, 0, 0, 0)
    assert libc.syscall(446, ctypes.c_int(fd), ctypes.c_uint32(0)) == 0
import torch
n = torch.cuda.device_count()
x = torch.ones(4, device="cuda").sum().item()
print("ok", n, x)
'''

works = []
for name, v in VARIANTS.items():
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(v)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, HOME="/tmp"))
    err = (r.stderr.strip().splitlines() or [""])[-1]
    print(f"{name:26} rc={r.returncode} {r.stdout.strip()} {err[:200]}", flush=True)
    if r.returncode == 0 and v and v.get("extra"):
        works.append(v["extra"])
open(os.environ.get("DIAG_OUT", "/tmp/diag-works"), "w").write((works or [""])[0])
