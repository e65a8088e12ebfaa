"""The sandbox every piece of proposal code runs in: Landlock (Linux ≥ 5.13, unprivileged) plus a supervisor.

    python -I -B -m autoresearch.harness.sandbox POLICY.json -- CMD ...

forks CMD, which applies POLICY to itself before it starts, and supervises it from outside the sandbox. POLICY is JSON:
    {"read": [paths], "write": [paths], "network": false}          (proposal code: allow-list)
    {"deny": [paths], "read_only": [paths], "network": true}        (the agent: everything else allowed)
`read` paths (files or folders) may be read and executed, `write` paths may also be changed; nothing else on the
filesystem can be opened. `deny` paths cannot be opened at all, `read_only` ones not changed. With "network": false no TCP bind/connect is allowed (Landlock ABI ≥ 4). From ABI 6
the sandbox also cannot signal processes outside it, nor reach abstract UNIX sockets outside it. At every ABI a
sandboxed process cannot ptrace (or read /proc/PID/mem of) a process outside its own sandbox.

Besides the policy, a sandboxed process may write its own /proc/PID entries (the CUDA driver does; another
process's are not reachable). The supervisor is a child subreaper: double-forked daemons of CMD are re-parented to it, and when CMD exits it
SIGKILLs every process still below it before exiting with CMD's code. The runner still kills the whole process
group and tree from outside, so a killed supervisor leaks nothing either.

`available()` says whether Landlock works here; `base_policy()` is what any Python program needs to run.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import sys
import sysconfig
import time
from pathlib import Path

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446    # the same on x86_64 and aarch64
_PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 38, 36
_RULE_PATH_BENEATH = 1

FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1                       # execute … make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FILE_ONLY = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX, SCOPE_SIGNAL = 1 << 0, 1 << 1
READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


class SandboxError(Exception):
    """Landlock is missing or refused the policy."""


def _libc():
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when there is none (not Linux, too old, or disabled)."""
    libc = _libc()
    if libc is None:
        return 0
    libc.syscall.restype = ctypes.c_long
    v = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))   # LANDLOCK_CREATE_RULESET_VERSION
    return max(0, int(v))


def available() -> tuple[bool, str]:
    """(works, why not) — said to the user when the sandbox cannot be had."""
    v = abi_version()
    if v >= 1:
        return True, f"Landlock ABI {v}"
    if not sys.platform.startswith("linux"):
        return False, f"Landlock is Linux-only (this is {sys.platform})"
    return False, ("this kernel has no Landlock (Linux ≥ 5.13 with CONFIG_SECURITY_LANDLOCK and `landlock` in the "
                   "lsm= boot list); containers may also block its system calls")


def _handled_fs(abi: int) -> int:
    mask = FS_ALL_V1
    if abi >= 2:
        mask |= FS_REFER
    if abi >= 3:
        mask |= FS_TRUNCATE
    if abi >= 5:
        mask |= FS_IOCTL_DEV
    return mask


FS_DIR_META = FS_READ_DIR | (((1 << 13) - 1) & ~(FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_READ_DIR)) | FS_REFER


def complement(deny: list[str], read_only: list[str]) -> list[tuple[str, str]]:
    """Rules that allow everything except `deny` (no access) and `read_only` (read and execute only).

    Landlock only grants, so the rest of the filesystem is granted piece by piece: every sibling of every folder
    on the way down to a protected path gets full access; the folders on the way get only the rights to list,
    create, remove and rename entries (a rename can never move a protected file to where it could be read:
    Landlock refuses a rename that would gain rights). Returns (path, "all" | "dirs" | "read") pairs."""
    protected = {os.path.realpath(p): "none" for p in deny}
    protected.update({os.path.realpath(p): "read" for p in read_only if os.path.realpath(p) not in protected})
    split = set()
    for p in protected:
        parent = os.path.dirname(p)
        while True:
            split.add(parent)
            if parent == "/":
                break
            parent = os.path.dirname(parent)
    rules = []
    for s in sorted(split):
        rules.append((s, "dirs"))
        try:
            names = os.listdir(s)
        except OSError:
            continue
        for name in names:
            child = os.path.join(s, name)
            if os.path.islink(child):       # a rule on a link lands on its target, which may be what is protected
                continue
            if child not in split and child not in protected:
                rules.append((child, "all"))
    rules += [(p, "read") for p, level in protected.items() if level == "read"]
    return rules


def restrict(read: list[str], write: list[str], *, network: bool = False, deny: list[str] = (),
             read_only: list[str] = ()) -> int:
    """Restrict this process (and what it starts) to the policy. Call while single-threaded. Returns the ABI.
    With `deny` or `read_only`, everything else is allowed (see `complement`) besides `read` and `write`."""
    libc = _libc()
    abi = abi_version()
    if libc is None or abi < 1:
        raise SandboxError(available()[1])
    handled = _handled_fs(abi)
    scoped = (SCOPE_ABSTRACT_UNIX | SCOPE_SIGNAL) if abi >= 6 else 0
    net = (NET_BIND_TCP | NET_CONNECT_TCP) if abi >= 4 and not network else 0
    attr = (ctypes.c_uint64 * 3)(handled, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    fd = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise SandboxError(f"landlock_create_ruleset failed: {os.strerror(ctypes.get_errno())}")
    try:
        for paths, access in ((read, READ & handled), (write, handled)):
            for p in paths:
                _add_path(libc, fd, p, access)
        if deny or read_only:
            levels = {"all": handled, "dirs": FS_DIR_META & handled, "read": READ & handled}
            for p, level in complement(list(deny), list(read_only)):
                _add_path(libc, fd, p, levels[level])
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SandboxError(f"prctl(NO_NEW_PRIVS) failed: {os.strerror(ctypes.get_errno())}")
        if libc.syscall(_SYS_RESTRICT, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise SandboxError(f"landlock_restrict_self failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    return abi


def _add_path(libc, ruleset_fd: int, path: str, access: int) -> None:
    try:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return                                      # a policy may name optional places (/lib64, a GPU device)
    try:
        if not os.path.isdir(path):
            access &= FILE_ONLY
        rule = (ctypes.c_uint8 * 12)()              # struct landlock_path_beneath_attr, packed: u64 + s32
        ctypes.c_uint64.from_buffer(rule, 0).value = access
        ctypes.c_int32.from_buffer(rule, 8).value = pfd
        if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset_fd), ctypes.c_int(_RULE_PATH_BENEATH),
                        ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise SandboxError(f"landlock_add_rule({path}) failed: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(pfd)


def base_policy() -> dict:
    """What a Python program with torch needs: the interpreter, its libraries, the system's, devices, /proc.
    The autoresearch package itself is readable (train.py imports the harness), nothing else of its checkout."""
    read = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc", "/proc", "/sys", "/opt",
            sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        read.add(sysconfig.get_paths()[key])
    pkg = Path(__file__).resolve().parents[1]       # autoresearch/ (an editable install lives in a checkout)
    read.add(str(pkg))
    for entry in sys.path:                          # site-packages and friends, never a project checkout
        p = Path(entry or ".").resolve()
        if p.is_dir() and ("site-packages" in p.parts or "dist-packages" in p.parts or p == pkg.parent / "lib"):
            read.add(str(p))
    return {"read": sorted(read), "write": ["/dev"], "network": False}


# ------------------------------------------------------------------------------------- the supervisor

def _children_of(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _kill_below(me: int) -> None:
    """SIGKILL every process below this one (re-parented daemons included), until none is left."""
    for _ in range(50):
        kids = _children_of(me)
        if not kids:
            return
        stack = list(kids)
        seen = set()
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            stack += _children_of(pid)
        for pid in seen:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.01)


def stop_on_end_of_input(proc, *, grace: float, kill=None) -> None:
    """Stop a helper process that cleans up and leaves when its stdin closes: close it and wait `grace` seconds;
    then SIGTERM and 5 s more; then `kill()` (default: SIGKILL to the process). Returns once it is reaped."""
    import subprocess
    try:
        proc.stdin.close()
        proc.wait(timeout=grace)
    except (OSError, subprocess.TimeoutExpired):
        try:
            proc.terminate()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            try:
                (kill or proc.kill)()
            except OSError:
                pass
    proc.wait()


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: with torch imported that takes ~0.6 s of a CPU, and a session's
    evaluator and its fork server stop one after the other. For processes whose work is all written and
    flushed by the time they return (the evaluator's records are renamed into place)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def restrict_policy(policy: dict) -> int:
    """Restrict this process to a policy document; its own /proc entries stay writable (the CUDA driver
    writes there). Call in the process that will run the untrusted code, while it is single-threaded."""
    write = list(policy.get("write", []))
    if not (policy.get("deny") or policy.get("read_only")):
        # not root: file permissions keep /proc/sys and other users' processes out of reach. As root only this
        # process's own entries (its subprocesses then cannot start CUDA: see RunRequest.to_environ)
        write.append("/proc" if os.geteuid() != 0 else f"/proc/{os.getpid()}")
    return restrict(policy.get("read", []), write, network=bool(policy.get("network")),
                    deny=policy.get("deny", []), read_only=policy.get("read_only", []))


def supervise(cmd: list[str], policy: dict) -> int:
    """Fork CMD, sandboxed; stay outside the sandbox (it cannot signal or trace this process), reap, clean up."""
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            restrict_policy(policy)
            os.execvp(cmd[0], cmd)
        except SandboxError as e:
            os.write(1, f"FAIL: sandbox: {e}\n".encode())
            os._exit(3)
        except OSError as e:
            os.write(2, f"sandbox: cannot run {cmd[0]}: {e.strerror}\n".encode())
        os._exit(127)

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 1
    while True:
        try:
            got, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if got == pid:
            code = os.waitstatus_to_exitcode(status)
            break
    _kill_below(os.getpid())
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -I -B -m autoresearch.harness.sandbox POLICY.json -- CMD ...", file=sys.stderr)
        return 2
    policy = json.loads(Path(argv[0]).read_text())
    return supervise(argv[2:], policy)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
