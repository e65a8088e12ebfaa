"""Experiments as Ray tasks on a cluster (`--executor ray`, the optional extra `pip install "autoresearch-ar[ray]"`).

The driver (`ar run` / `ar sweep`) keeps everything that makes the results one story: the queue, the
proposals (made and committed in a driver-side worktree per slot), the decisions, results.tsv and the hooks.
A task gets one experiment: the commit as a git bundle (bytes through the object store) and its RunRequest.
On the worker it clones the bundle into a temp folder, checks that the data is prepared there and hashes as
the driver's did, and runs the same trial as on one machine (experiment/trial.py: fresh workspace, sandboxed
training on ar's clock, the trusted evaluator on that node) and returns the trial and the experiment's files. Each task asks for one
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

from autoresearch.errors import ConfigError, GitError
from autoresearch.gitops import short
from autoresearch.harness import logfmt
from autoresearch.experiment.metrics import parse_step
from autoresearch.experiment import settle
from autoresearch.process import RunResult
from autoresearch.slots import Slot, parse_gpus

MAX_LOSSES = 3           # a task lost with its worker this often is recorded as a crash


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("--executor ray needs Ray: pip install 'autoresearch-ar[ray]' (or pip install ray)") from None
    return ray


# ------------------------------------------------------------------------------------- on the worker

def run_on_worker(bundle: bytes, req, manifest: dict, allowance):
    """One experiment on a worker (a streaming generator task): clone the bundle, check the data, then the same
    trial as on one machine (experiment/trial.py: fresh workspace, sandboxed run on ar's clock, the trusted
    evaluator on this node's GPU). Yields {"step": line, "node": host} about twice a second while training, then
    {"final": {...}} with the trial and the experiment's files as bytes."""
    import dataclasses

    from autoresearch.experiment import evaluate
    from autoresearch.experiment.trial import run_trial
    from autoresearch.gitops import GitRepo
    from autoresearch.harness.data import check_prepared
    from autoresearch.harness.env import default_cache
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
            subprocess.run(["git", "-C", str(repo), "checkout", "--quiet", "--detach", req.commit], **quiet)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"worker {node} could not check out {req.commit[:7]}: {(e.stderr or '').strip()}") from None
        from autoresearch.errors import DataError
        try:
            tok_dir = check_prepared(default_cache(), req.dataset, req.profile.vocab_size)
        except DataError as e:
            msg = (f"{logfmt.FAIL_PREFIX} worker {node} has no prepared data: {e}; prepare it on every worker "
                   f"(`ar prepare` there, or a shared AR_CACHE) before `--executor ray`")
            yield {"final": {"node": node, "failed": msg}}
            return
        cmd = list(req.train_command)
        if cmd and Path(cmd[0]).name.startswith("python"):
            cmd = [sys.executable, *cmd[1:]]        # the worker's interpreter, not the driver's path
        from autoresearch.experiment import compile_cache  # this worker's own store: filled by trusted runs that ran here
        req = dataclasses.replace(req, tok_dir=tok_dir, cache=default_cache(), train_command=tuple(cmd),
                                  compile_store=compile_cache.store_dir(default_cache()) if req.compile_store else None)
        exp_dir = work / "exp"
        exp_dir.mkdir()
        steps: queue.Queue[str] = queue.Queue()
        box: dict = {}
        server = evaluate.Server(work / "evaluator.log", req.slot_env)

        def trial() -> None:
            try:
                box["t"] = run_trial(req, GitRepo(repo), work_root=work / "run", exp_dir=exp_dir, manifest=manifest,
                                     fingerprint=None, allowance=allowance, server=server,
                                     on_line=lambda ln: steps.put(ln) if ln.startswith("step ") else None)
            except BaseException as e:  # noqa: BLE001 — handed to the driver below
                box["e"] = e
            finally:
                server.close()

        th = threading.Thread(target=trial, daemon=True)
        th.start()
        last, latest = 0.0, None
        while th.is_alive():
            try:
                latest = steps.get(timeout=0.25)
            except queue.Empty:
                pass
            if latest and time.monotonic() - last >= 0.5:
                yield {"step": latest, "node": node}
                last, latest = time.monotonic(), None
        th.join()
        if "e" in box:
            raise box["e"]
        files = {f.name: f.read_bytes() for f in exp_dir.iterdir() if f.is_file()}
        yield {"final": {"node": node, "trial": box["t"], "files": files}}
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
        from autoresearch.executors.local import LocalExecutor
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

    def holds(self, loop, ctx) -> bool:
        return False                  # a run waits for the baseline before it is sent to a worker

    def train(self, loop, ctx, x, budget: float, seed: int):
        """local.train_here on the cluster: the same trial on a worker; its files land in x.exp_dir."""
        ray = _ray()
        req = loop.request(ctx, x, budget, seed)
        try:
            bundle = ray.put(self._bundle(ctx.git, x.sha, x.spec.id))
        except GitError as e:
            return self._failed(x, f"could not bundle {short(x.sha)}: {e}"), None
        loop.events.phase(x, "training", commit=short(x.sha), description=x.description, budget=budget)
        x.t_run = 0.0
        for attempt in range(1, MAX_LOSSES + 1):
            ref = self._remote.remote(bundle, req, loop.fingerprint.eval_files, loop.allowance)
            with self._lock:
                self._running[ctx.slot.index] = ref
            try:
                out = self._follow(loop, ctx, x, ref, budget)
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
                loop.say(f"experiment {x.spec.id:04d}: its Ray worker was lost ({type(e).__name__}); "
                         f"sent to the cluster again ({attempt}/{MAX_LOSSES})", "warn")
            finally:
                with self._lock:
                    self._running.pop(ctx.slot.index, None)
        else:
            return self._failed(x, f"its Ray worker was lost {MAX_LOSSES} times; not sent again"), None
        if "failed" in out:
            why = out["failed"].removeprefix(logfmt.FAIL_PREFIX).strip()
            return self._failed(x, why, stop=why), None
        for name, data in out["files"].items():
            (x.exp_dir / name).write_bytes(data)
        log = x.exp_dir / "train.log"
        with open(log, "ab") as f:
            f.write(f"[ar] ran on Ray node {out['node']}\n".encode())
        trial = out["trial"]
        trial.outcome.result.log_path = log
        settle.take(loop, x, trial)
        if trial.verdict.holdout_bpb is not None:
            settle.keep_private(loop, x, trial.verdict.holdout_bpb)
        return trial.outcome.result, None

    @staticmethod
    def _follow(loop, ctx, x, gen, budget: float) -> dict:
        """Read a task's stream: step lines to the live view and the event stream, then its final result."""
        from autoresearch.experiment.context import Event
        ray = _ray()
        for ref in gen:
            item = ray.get(ref)
            if "final" in item:
                return item["final"]
            p = parse_step(item["step"])
            if p is not None:
                loop.emit(Event("step", spec=x.spec, step=p, time_budget=budget))
                loop.events.step(x, p, node=item["node"])
        raise RuntimeError("the Ray task ended without a result")

    @staticmethod
    def _failed(x, why: str, stop: str | None = None) -> RunResult:
        """A run that never happened: recorded as a crash (or interrupted) with `why`."""
        from autoresearch.experiment.evaluate import Verdict
        from autoresearch.experiment.execute import TrainOutcome
        log = x.exp_dir / "train.log"
        with open(log, "a") as f:
            f.write(f"{logfmt.FAIL_PREFIX} {why}\n")
        result = RunResult(None, False, stop or why, 0.0, log, False)
        x.outcome = TrainOutcome(result, None, 0.0, None, None, False)
        x.verdict = Verdict(None, None, None, {}, None)
        return result
