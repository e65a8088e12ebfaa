"""The sandbox every piece of proposal code runs in: Landlock (Linux ≥ 5.13, unprivileged) plus a supervisor.

    python -I -B -m autoresearch.harness.sandbox POLICY.json -- CMD ...

forks CMD, which applies POLICY to itself before it starts, and supervises it from outside the sandbox. POLICY is JSON:
    {"read": [paths], "write": [paths], "network": false}          (proposal code: allow-list)
    {"deny": [paths], "read_only": [paths], "network": true}        (the agent: everything else allowed)
`read` paths (files or folders) may be read and executed, `write` paths may also be changed; nothing else on the
filesystem can be opened. `deny` paths cannot be opened at all, `read_only` ones not changed. With "network": false no TCP bind/connect is allowed (Landlock ABI ≥ 4). From ABI 6
the sandbox also cannot signal processes outside it, nor reach abstract UNIX sockets outside it. At every ABI a
sandboxed process cannot ptrace (or read /proc/PID/mem of) a process outside its own sandbox.

Nothing a run creates outlives it or reaches the next one (`isolate`): every sandboxed process (a training run, a
model worker) gets its own IPC namespace (System V shared memory, semaphores, message queues and POSIX message
queues), its own network namespace when the policy has no network (abstract UNIX sockets, localhost), and a fresh
/dev/shm and /dev/mqueue in its own mount namespace, all of which the kernel discards with its last process; as
an ordinary user through a user namespace. Keyrings are closed by seccomp. Where the kernel allows no
namespace, seccomp refuses the System V and POSIX IPC calls too and /dev/shm and /dev/mqueue are not writable
(`isolation()` says which; `ar doctor` shows it). A supervisor run as root starts the sandboxed process as
`nobody` (see `sandbox_ids`), keeping only CAP_DAC_READ_SEARCH so that what the policy lets it read stays
readable; what it must write is chowned to that uid by the trusted side (`give_to_sandbox`).

A `hide` list in an allow-list policy names paths inside readable ones that stay unreadable (the raw files a
dataset's validation text comes from): the read rules are carved around them.

Besides the policy, a sandboxed process may write its own /proc/PID entries (the CUDA driver does). An
allow-list policy that runs as an ordinary user or as `nobody` gets all of /proc writable (torch.compile's worker
processes start CUDA too): file permissions keep /proc/sys out of reach, but not the writable entries of the same
uid's other processes (coredump_filter, oom_score_adj; see docs/reliability.md). Kept as root, only its own.

A policy with "shared_ipc": true (the evaluator's model worker on a GPU, whose buffers come through CUDA IPC from
a buffer owner of its own; see evaluator.py) gets no namespaces and keeps its uid, which CUDA IPC needs (the
importer opens the exporting process's driver file in /dev/shm, mode 0600, for writing). Instead seccomp refuses
System V / POSIX IPC and keyrings, and the write rules are narrowed: in /dev/shm only its "ipc_files" (its
owner's files, which the evaluator removes once worker and owner are reaped), in /dev only `shared_devices()`
(file rules: nothing can be made there), in /proc only its own entries.

The supervisor is a child subreaper: double-forked daemons of CMD are re-parented to it, and when CMD exits it
SIGKILLs every process still below it before exiting with CMD's code. The runner still kills the whole process
group and tree from outside, so a killed supervisor leaks nothing either.

`available()` says whether Landlock works here; `base_policy()` is what any Python program needs to run.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
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

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 0x4000, 1 << 18
_PR_SET_DUMPABLE, _PR_SET_KEEPCAPS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _PR_SET_SECCOMP = 4, 8, 47, 2, 22
CAP_DAC_READ_SEARCH = 2
# system calls seccomp refuses: keyrings always; System V and POSIX IPC where no IPC namespace could be had
_SYSCALLS = {   # name: (x86_64, aarch64)
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219),
    "shmget": (29, 194), "shmat": (30, 196), "shmctl": (31, 195), "shmdt": (67, 197), "semget": (64, 190),
    "semop": (65, 193), "semctl": (66, 191), "semtimedop": (220, 192), "msgget": (68, 186), "msgsnd": (69, 189),
    "msgrcv": (70, 188), "msgctl": (71, 187), "mq_open": (240, 180), "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182), "mq_timedreceive": (243, 183), "mq_notify": (244, 184),
    "mq_getsetattr": (245, 185)}
KEYRING_CALLS = ("add_key", "request_key", "keyctl")
IPC_CALLS = tuple(n for n in _SYSCALLS if n not in KEYRING_CALLS)


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
        mode, why = isolation()
        if mode == "none":
            return False, f"runs cannot be kept apart: {why}"
        return True, f"Landlock ABI {v}; {why}"
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
    rules = [(path, "dirs" if on_the_way else "all") for path, on_the_way in _around(split, set(protected))]
    rules += [(p, "read") for p, level in protected.items() if level == "read"]
    return rules


def _around(split: set[str], skip: set[str]) -> list[tuple[str, bool]]:
    """(path, on the way): each folder of `split`, in order, then each entry of it that is neither on the way,
    nor in `skip`, nor a link (a rule on a link lands on its target, which may be what is protected)."""
    out = []
    for folder in sorted(split):
        out.append((folder, True))
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            child = os.path.join(folder, name)
            if child not in split and child not in skip and not os.path.islink(child):
                out.append((child, False))
    return out


def carve(read: list[str], hide: list[str]) -> list[tuple[str, int]]:
    """Read rules (path, access) that grant `read` except what lies under a `hide` path: a read path that holds
    a hidden one is granted piece by piece (its siblings on the way down whole, the folders on the way list-only;
    Landlock rights are inherited, so a hidden folder's names can be listed, its files not read).
    Paths are compared as real paths (a rule lands on the inode a link points to)."""
    hidden = {os.path.realpath(h) for h in hide}
    out: list[tuple[str, int]] = []
    for p in {os.path.realpath(r) for r in read}:
        if any(p == h or p.startswith(h + "/") for h in hidden):
            continue                                  # the read path is hidden, or lies inside a hidden one
        inside = [h for h in hidden if h.startswith(p.rstrip("/") + "/")]
        if not inside:
            out.append((p, READ))
            continue
        split = set()
        for h in inside:
            d = os.path.dirname(h)
            while len(d) >= len(p):
                split.add(d)
                if d == p:
                    break
                d = os.path.dirname(d)
        # listing is inherited downwards: names show, contents do not
        out += [(path, FS_READ_DIR if on_the_way else READ) for path, on_the_way in _around(split, hidden)]
    return out


def restrict(read: list[str], write: list[str], *, network: bool = False, deny: list[str] = (),
             read_only: list[str] = (), hide: list[str] = ()) -> int:
    """Restrict this process (and what it starts) to the policy. Call while single-threaded. Returns the ABI.
    With `deny` or `read_only`, everything else is allowed (see `complement`) besides `read` and `write`; `hide`
    paths stay unreadable even inside `read` ones (see `carve`)."""
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
        for p, access in carve(list(read), list(hide)) if hide else [(p, READ) for p in read]:
            _add_path(libc, fd, p, access & handled)
        for p in write:
            _add_path(libc, fd, p, handled)
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


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (one that exited and awaits its parent's wait)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_below(me: int, spare=()) -> None:
    """SIGKILL and reap every process below this one (re-parented daemons included), until none is left; all
    but the `spare` children and what is still below them."""
    for _ in range(50):
        kids = [k for k in _children_of(me) if k not in spare]
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
                if spare and not [k for k in _children_of(me) if k not in spare]:
                    break                   # the spared children live on: nothing else to wait for
                time.sleep(0.01)


def owner_files(pid: int) -> list[str]:
    """The files in /dev/shm named for a buffer owner's pid: the CUDA driver's of the exporting process
    (`cuda.shm.<n>.<pid in hex>.<n>`) and torch's reference counts (`torch_<pid>_<n>_<n>`)."""
    import glob
    return sorted(set(glob.glob(f"/dev/shm/cuda.shm.*.{pid:x}.*") + glob.glob(f"/dev/shm/torch_{pid}_*")))


def remove_owner_files(pid: int, files=()) -> list[str]:
    """Remove a reaped owner's files in /dev/shm (`files`, the ones its worker could write, and any other named
    for its pid); returns those removed."""
    gone = []
    for f in sorted(set(files) | set(owner_files(pid))):
        try:
            os.unlink(f)
            gone.append(f)
        except FileNotFoundError:
            pass
    return gone


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
    """Restrict this process to a policy document. Call in the process that will run the untrusted code, while
    it is single-threaded. An allow-list policy (proposal code) is first isolated (`isolate`: its own
    namespaces, not root); /proc is then writable as for any unprivileged user (the CUDA driver writes its own
    entries; file permissions keep /proc/sys and other users' processes out of reach)."""
    write = list(policy.get("write", []))
    if policy.get("shared_ipc"):
        # the evaluator's model worker on a GPU, whose buffers a buffer owner of its own exports (evaluator.py):
        # CUDA IPC needs the owner's IPC and mount namespaces and uid (an importer opens the driver's file of the
        # exporting process, mode 0600 in /dev/shm, for writing). So no namespaces and no change of uid. Instead:
        # System V / POSIX IPC calls and keyrings refused (seccomp); of /dev/shm only the owner's files writable
        # (`ipc_files`; the evaluator removes them once worker and owner are reaped); of /dev only the devices
        # CUDA needs, each a rule of its own (nothing can be made there); of /proc only its own entries (a
        # process of the same uid is not its to change). Nothing it writes outlives it.
        write = [w for w in write if w != "/dev"] + [str(f) for f in policy.get("ipc_files", [])]
        write += shared_devices() + [f"/proc/{os.getpid()}"]
        libc = _libc()
        if libc is None:
            raise SandboxError(available()[1])
        _seccomp(libc, KEYRING_CALLS + IPC_CALLS)
        return restrict(policy.get("read", []), write, network=False, hide=policy.get("hide", []))
    if not (policy.get("deny") or policy.get("read_only")):
        mode = isolate(network=bool(policy.get("network")))
        if os.geteuid() != 0:
            write.append("/proc")
        else:   # root kept (a GPU node nobody cannot open): only its own entries, and compile in-process, since
            write.append(f"/proc/{os.getpid()}")         # a subprocess then could not write its own for CUDA
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        if mode == "seccomp":                 # no namespaces: what /dev/shm or /dev/mqueue hold would outlive the run
            write = [w for w in write if w != "/dev"] + _dev_except(("/dev/shm", "/dev/mqueue"))
    return restrict(policy.get("read", []), write, network=bool(policy.get("network")),
                    deny=policy.get("deny", []), read_only=policy.get("read_only", []), hide=policy.get("hide", []))


SHARED_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/nvidia*",
                  "/dev/nvidia*/*")


def shared_devices() -> list[str]:
    """The devices a shared-namespace model worker may open for writing: the character devices among
    `SHARED_DEVICES` (what Python and the CUDA driver open). Neither a folder (in /dev a root worker could make
    a file that outlives it) nor a device whose writes outlive the writer (a disk, the kernel log)."""
    import glob
    import stat
    out = set()
    for pattern in SHARED_DEVICES:
        for p in glob.glob(pattern):
            try:
                if stat.S_ISCHR(os.stat(p).st_mode):
                    out.add(os.path.realpath(p))
            except OSError:
                pass
    return sorted(out)


def _dev_except(kept_out: tuple[str, ...]) -> list[str]:
    try:
        return [p for p in (os.path.join("/dev", n) for n in os.listdir("/dev"))
                if p not in kept_out and not os.path.islink(p)]     # a link (/dev/stderr) may point at a pipe
    except OSError:
        return []


# ------------------------------------------------------------------------------- isolation between runs

_IDS: list = []


def sandbox_ids() -> tuple[int, int] | None:
    """(uid, gid) a sandboxed process runs as when the supervisor is root (`nobody`), or None: not root, the
    process keeps the user's own uid (inside a user namespace where the kernel allows one). Also None, root
    stays root, where a GPU device node is not open to every user (nobody could not start CUDA)."""
    if _IDS:
        return _IDS[0]
    ids = None
    if os.geteuid() == 0 and not _gpu_nodes_closed():
        import grp
        import pwd
        try:
            uid = pwd.getpwnam("nobody").pw_uid
        except KeyError:
            uid = 65534
        gid = 65534
        for name in ("nogroup", "nobody"):
            try:
                gid = grp.getgrnam(name).gr_gid
                break
            except KeyError:
                continue
        ids = (uid, gid)
    _IDS.append(ids)
    return ids


def _gpu_nodes_closed() -> bool:
    import glob
    import stat
    for node in glob.glob("/dev/nvidia*") + glob.glob("/dev/dri/renderD*") + glob.glob("/dev/kfd"):
        try:
            st = os.stat(node)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and (st.st_mode & 0o006) != 0o006:
            return True
    return False


def reachable_by_others(path) -> bool:
    """Whether every folder above `path` lets any user through (o+x). A sandboxed `nobody` reaches its folders
    under a root-only one (/root, pytest's /tmp/pytest-of-root) through CAP_DAC_READ_SEARCH, but access(2) asks
    with no capabilities: gcc's check of TMPDIR fails there, and it falls back to /tmp, which it may not write."""
    p = Path(path).resolve()
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in p.parents)


def give_to_sandbox(*paths) -> None:
    """Make `paths` (folders, recursively, and files) the sandboxed uid's, so that it can write them; a no-op
    unless root (see `sandbox_ids`)."""
    ids = sandbox_ids()
    if ids is None:
        return
    for p in paths:
        p = str(p)
        if not os.path.lexists(p):
            continue
        os.chown(p, *ids, follow_symlinks=False)
        if os.path.isdir(p) and not os.path.islink(p):
            for dirpath, dirnames, filenames in os.walk(p):
                for n in dirnames + filenames:
                    os.chown(os.path.join(dirpath, n), *ids, follow_symlinks=False)


def _unshare(libc, flags: int) -> bool:
    return libc.unshare(ctypes.c_int(flags)) == 0


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _namespaces(libc, network: bool) -> bool:
    """Unshare IPC, mount (and network, without network access) namespaces; an ordinary user through a user
    namespace that maps only its own uid and gid. Then mount a fresh /dev/shm and /dev/mqueue."""
    flags = CLONE_NEWIPC | CLONE_NEWNS | (0 if network else CLONE_NEWNET)
    if os.geteuid() == 0:
        if not _unshare(libc, flags):
            return False
    else:
        uid, gid = os.geteuid(), os.getegid()
        if not _unshare(libc, CLONE_NEWUSER | flags):
            return False
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError:
            return False
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    for target, fstype, opts in ((b"/dev/shm", b"tmpfs", b"mode=1777"), (b"/dev/mqueue", b"mqueue", None)):
        if os.path.isdir(target) and libc.mount(fstype, target, fstype, _MS_NOSUID | _MS_NODEV, opts) != 0:
            return False
    return True


def _capset(libc, caps: int) -> None:
    """Set this process's effective, permitted and inheritable capabilities to `caps` (a mask below 32)."""
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)          # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)(caps, caps, caps, 0, 0, 0)
    nr = 126 if platform.machine() == "x86_64" else 91
    if libc.syscall(ctypes.c_long(nr), ctypes.byref(header), ctypes.byref(data)) != 0:
        raise SandboxError(f"capset failed: {os.strerror(ctypes.get_errno())}")


def _drop_root(libc) -> None:
    """Become the sandbox's uid (`nobody`), keeping only CAP_DAC_READ_SEARCH, also across exec (ambient)."""
    uid, gid = sandbox_ids()
    libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _capset(libc, 1 << CAP_DAC_READ_SEARCH)
    if libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0) != 0:
        raise SandboxError(f"cannot keep CAP_DAC_READ_SEARCH: {os.strerror(ctypes.get_errno())}")
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)      # a setuid leaves /proc/self root's; the CUDA driver writes there


def _seccomp(libc, names: tuple[str, ...]) -> None:
    """Refuse the named system calls with EPERM (and every call of another architecture's ABI)."""
    x86 = platform.machine() == "x86_64"
    arch = 0xC000003E if x86 else 0xC00000B7
    nrs = [_SYSCALLS[n][0 if x86 else 1] for n in names]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, eperm), (ld, 0, 0, 0)]
    if x86:
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]          # the x32 ABI
    for i, nr in enumerate(nrs):
        prog.append((jeq, len(nrs) - i, 0, nr))
    prog += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    fprog = Prog(len(prog), filters)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(_PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0) != 0:
        raise SandboxError(f"cannot install the seccomp filter: {os.strerror(ctypes.get_errno())}")


def isolate(network: bool = False) -> str:
    """Cut this process (and what it starts) off from every IPC object of other runs, and make sure what it
    creates dies with it. Call while single-threaded, before `restrict`. Returns "namespaces" or "seccomp"."""
    libc = _libc()
    if libc is None:
        raise SandboxError(available()[1])
    mode = "namespaces" if _namespaces(libc, network) else "seccomp"
    if sandbox_ids() is not None:
        _drop_root(libc)
    elif mode == "namespaces":
        _capset(libc, 0)             # the user namespace's capabilities: none are needed past this point
    _seccomp(libc, KEYRING_CALLS + (IPC_CALLS if mode == "seccomp" else ()))
    return mode


_ISOLATION: tuple[str, str] | None = None


def isolation() -> tuple[str, str]:
    """(mode, a sentence): how runs are kept apart here, probed once in a throw-away child. mode is
    "namespaces", "seccomp" (no namespace could be had: IPC calls refused, /dev/shm not writable) or "none"."""
    global _ISOLATION
    if _ISOLATION is not None:
        return _ISOLATION
    sandbox_ids()                     # looked up here, not in the forked child (no NSS calls after a fork)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            mode = isolate(network=False)
        except BaseException as e:
            mode = f"none {e}"
        os.write(w, mode.encode())
        os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    os.waitpid(pid, 0)
    mode, _, why = got.decode().partition(" ")
    who = ("through a user namespace" if os.geteuid() != 0 else "as nobody (the supervisor is root)"
           if sandbox_ids() else "as root: a GPU device node is not open to every user, so it cannot drop root")
    _ISOLATION = {
        "namespaces": ("namespaces", f"each sandboxed process gets its own IPC, mount and network namespaces and a "
                                     f"fresh /dev/shm, {who}; keyrings refused by seccomp"),
        "seccomp": ("seccomp", "no namespace could be had: seccomp refuses System V and POSIX IPC and keyrings, "
                               "/dev/shm and /dev/mqueue are not writable (multiprocessing in train.py fails)"),
    }.get(mode or "none", ("none", f"neither namespaces nor seccomp work here ({why or 'unknown'})"))
    return _ISOLATION


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
