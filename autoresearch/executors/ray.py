"""Experiments as Ray tasks on a cluster (`--executor ray`, the optional extra `pip install "autoresearch-ar[ray]"`).

The driver (`ar run` / `ar sweep`) keeps everything that makes the results one story: the queue, the
proposals (made and committed in a driver-side worktree per slot), the decisions, results.tsv and the hooks.
A task gets one experiment: the commit as a git bundle (bytes through the object store), the command, the
AR_* settings and the hard timeout. On the worker it clones the bundle into a temp folder, checks that the
data is prepared there, runs train.py with the same runner as on one machine (own process group, hard
timeout, capped log) and returns the log, the evaluator record and the exit facts. Each task asks for one
unit of `ray_resource` (default `GPU`; tests use a custom resource on CPUs).

Failures: a worker without prepared data ends its task with a `FAIL:` line naming the node and the fix; it
is recorded as a crash and not retried. A lost worker or node (the task dies with it) sends the experiment
back to the cluster, up to MAX_LOSSES times, and the loop goes on.
Step lines stream back (a generator task, about two a second) to the live view and `ar status`.
"""

from __future__ import annotations

import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..errors import ConfigError, GitError
from ..gitops import short
from ..harness import logfmt
from ..metrics import parse_step
from ..runner import RunResult, run_training
from . import Slot, parse_gpus

MAX_LOSSES = 3           # a task lost with its worker this often is recorded as a crash
RUNNER_VARS = ("AR_TIME_BUDGET", "AR_EVAL_TOKENS", "AR_DATASET", "AR_SEED", "AR_PROFILE", "AR_PEAK_TFLOPS",
               "AR_GPU_TABLE", "AR_GPU_MEMORY_GB")


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'autoresearch-ar[ray]' (or pip install ray)") from None
    return ray


# ------------------------------------------------------------------------------------- on the worker

def run_on_worker(bundle: bytes, sha: str, cmd: list[str], env: dict[str, str], timeout: float, max_log_bytes: int,
                  data: tuple[str, int] | None):
    """One experiment on a worker (a streaming generator task): clone the bundle, check the data, train.
    Yields {"step": line, "node": host} about twice a second while training, then {"final": {...}} with the
    log and record as bytes and the exit facts."""
    node = socket.gethostname()
    work = Path(tempfile.mkdtemp(prefix="ar-task-"))
    try:
        (work / "exp.bundle").write_bytes(bundle)
        repo = work / "repo"
        quiet = {"capture_output": True, "text": True, "check": True}
        try:
            subprocess.run(["git", "init", "--quiet", str(repo)], **quiet)
            subprocess.run(["git", "-C", str(repo), "fetch", "--quiet", str(work / "exp.bundle"), "+refs/*:refs/b/*"],
                           **quiet)
            subprocess.run(["git", "-C", str(repo), "checkout", "--quiet", "--detach", sha], **quiet)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"worker {node} could not check out {sha[:7]}: {(e.stderr or '').strip()}") from None
        if data is not None:
            from ..errors import DataError
            from ..harness.data import check_prepared
            from ..harness.env import default_cache
            try:
                check_prepared(default_cache(), data[0], data[1])
            except DataError as e:
                msg = (f"{logfmt.FAIL_PREFIX} worker {node} has no prepared data: {e}; prepare it on every worker "
                       f"(`ar prepare` there, or a shared AR_CACHE) before `--executor ray`")
                yield {"final": {"node": node, "log": (msg + "\n").encode(), "record": None, "returncode": 3,
                                 "timed_out": False, "stop_reason": "no prepared data", "wall": 0.0,
                                 "truncated": False}}
                return
        run_env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
        run_env.update(env)
        run_env["AR_RESULT_FILE"] = str(work / "record.json")
        if cmd and Path(cmd[0]).name.startswith("python"):
            cmd = [sys.executable, *cmd[1:]]        # the worker's interpreter, not the driver's path
        steps: queue.Queue[str] = queue.Queue()
        box: dict = {}

        def train() -> None:
            try:
                box["r"] = run_training(cmd, cwd=repo, env=run_env, log_path=work / "train.log", timeout=timeout,
                                        max_log_bytes=max_log_bytes,
                                        on_line=lambda ln: steps.put(ln) if ln.startswith("step ") else None)
            except BaseException as e:  # noqa: BLE001 — handed to the driver below
                box["e"] = e

        t = threading.Thread(target=train, daemon=True)
        t.start()
        last, latest = 0.0, None
        while t.is_alive():
            try:
                latest = steps.get(timeout=0.25)
            except queue.Empty:
                pass
            if latest and time.monotonic() - last >= 0.5:
                yield {"step": latest, "node": node}
                last, latest = time.monotonic(), None
        t.join()
        if "e" in box:
            raise box["e"]
        r, record = box["r"], work / "record.json"
        yield {"final": {"node": node, "log": (work / "train.log").read_bytes(),
                         "record": record.read_bytes() if record.exists() else None, "returncode": r.returncode,
                         "timed_out": r.timed_out, "stop_reason": r.stop_reason, "wall": r.wall_seconds,
                         "truncated": r.log_truncated}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------- on the driver

class RayExecutor:
    name = "ray"

    def __init__(self, cfg):
        self.cfg = cfg
        self.slots: list[Slot] = []
        self._local = None
        self._running: dict[int, object] = {}   # slot index -> ObjectRef of its task
        self._lock = threading.Lock()
        self._remote = None
        self._stopping = False

    def open(self, loop) -> None:
        ray = _ray()
        from .local import LocalExecutor
        if not ray.is_initialized():
            ray.init(address=self.cfg.ray_address, logging_level="WARNING", log_to_driver=False,
                     include_dashboard=False)
        units = int(ray.cluster_resources().get(self.cfg.ray_resource, 0))
        if self.cfg.gpus:
            self.slots = parse_gpus(self.cfg.gpus, probe=False)
            if any(s.kind != "ray" for s in self.slots):
                raise ConfigError("with --executor ray, --gpus is ray:N (experiments in flight), or leave it out")
        else:
            if units < 1:
                raise ConfigError(f"the Ray cluster has no {self.cfg.ray_resource!r} resource; start its nodes with "
                                  f"it, or set ray_resource")
            self.slots = [Slot(i, None, "ray") for i in range(units)]
        opts = {"num_cpus": 0, "max_retries": 0, "num_returns": "streaming"}
        if self.cfg.ray_resource == "GPU":
            opts["num_gpus"] = 1
        else:
            opts["resources"] = {self.cfg.ray_resource: 1}
        self._remote = ray.remote(run_on_worker).options(**opts)
        self._local = LocalExecutor([])
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
        loop.say(f"Ray cluster: {units} {self.cfg.ray_resource} on {alive} node(s)")

    def worktree(self, loop, slot: Slot):
        return self._local.worktree(loop, slot)

    def prepare_view(self, view) -> None:
        view._train = lambda x, budget, seed, _v=view: self.train(_v, x, budget, seed)

    def close(self) -> None:
        self._running.clear()

    def interrupt(self) -> None:
        ray = _ray()
        self._stopping = True
        with self._lock:
            refs = list(self._running.values())
        for ref in refs:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 — a task that already finished cannot be cancelled
                pass

    def _bundle(self, git, sha: str, exp_id: int) -> bytes:
        ref = f"refs/ar-bundle/{os.getpid()}/{exp_id}"
        with tempfile.TemporaryDirectory(prefix="ar-bundle-") as d:
            git._git("update-ref", ref, sha)
            try:
                git._git("bundle", "create", "--quiet", str(Path(d) / "b"), ref)
            finally:
                git._git("update-ref", "-d", ref)
            return (Path(d) / "b").read_bytes()

    def train(self, view, x, budget: float, seed: int):
        """Loop._train on the cluster: returns (RunResult, None) with the log and record in x.exp_dir."""
        ray = _ray()
        record = x.exp_dir / "record.json"
        record.unlink(missing_ok=True)
        env = {"AR_TIME_BUDGET": f"{budget:g}", "AR_EVAL_TOKENS": str(view.eval_tokens), "AR_DATASET": view.cfg.dataset,
               "AR_SEED": str(seed), "AR_PROFILE": view.profile.name}
        env.update({k: os.environ[k] for k in RUNNER_VARS if k in os.environ and k not in env})
        data = (view.cfg.dataset, view.profile.vocab_size) if view.cfg.prepare_data else None
        timeout = budget + view.cfg.startup_allowance + view.cfg.eval_allowance
        try:
            bundle = ray.put(self._bundle(view.git, x.sha, x.spec.id))
        except GitError as e:
            return self._failed(x, f"could not bundle {short(x.sha)}: {e}"), None
        view._status_exp(x, "training", budget=budget)
        x.t_run = 0.0          # the record comes back with the result; another machine's clock is not compared
        t0 = time.monotonic()
        for attempt in range(1, MAX_LOSSES + 1):
            ref = self._remote.remote(bundle, x.sha, list(view.cfg.train_command), env, timeout,
                                      int(view.cfg.max_log_mb * 2**20), data)
            with self._lock:
                self._running[view._slot.index] = ref
            try:
                out = self._follow(view, x, ref, budget)
                break
            except (ray.exceptions.TaskCancelledError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError, ray.exceptions.RayTaskError) as e:
                if self._stopping or isinstance(e, ray.exceptions.TaskCancelledError):
                    return self._failed(x, "interrupted", stop="interrupted"), None
                if isinstance(e, ray.exceptions.RayTaskError) and not isinstance(
                        e, (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError)):
                    cause = getattr(e, "cause", None)
                    why = f"{type(cause).__name__}: {cause}" if cause is not None else str(e).strip().splitlines()[-1]
                    return self._failed(x, f"the Ray task failed: {why}"), None
                view.say(f"experiment {x.spec.id:04d}: its Ray worker was lost ({type(e).__name__}); "
                         f"sent to the cluster again ({attempt}/{MAX_LOSSES})", "warn")
            finally:
                with self._lock:
                    self._running.pop(view._slot.index, None)
        else:
            return self._failed(x, f"its Ray worker was lost {MAX_LOSSES} times; not sent again"), None
        log = x.exp_dir / "train.log"
        log.write_bytes(out["log"] + f"[ar] ran on Ray node {out['node']}\n".encode())
        if out["record"] is not None:
            record.write_bytes(out["record"])
        view._status_slot(view._slot, None, None, keep_experiment=True, node=out["node"])
        return RunResult(out["returncode"], out["timed_out"], out["stop_reason"], time.monotonic() - t0, log,
                         out["truncated"]), None

    @staticmethod
    def _follow(view, x, gen, budget: float) -> dict:
        """Read a task's stream: step lines to the live view and status.json, then its final result."""
        from ..loop import Event
        ray = _ray()
        for ref in gen:
            item = ray.get(ref)
            if "final" in item:
                return item["final"]
            p = parse_step(item["step"])
            if p is not None:
                view._emit(Event("step", spec=x.spec, step=p, time_budget=budget))
                view._status_slot(view._slot, None, p.__dict__, keep_experiment=True, node=item["node"])
        raise RuntimeError("the Ray task ended without a result")

    @staticmethod
    def _failed(x, why: str, stop: str | None = None) -> RunResult:
        log = x.exp_dir / "train.log"
        with open(log, "a") as f:
            f.write(f"{logfmt.FAIL_PREFIX} {why}\n")
        return RunResult(None, False, stop or why, 0.0, log, False)
