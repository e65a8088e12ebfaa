"""`--executor ray` on a real local Ray cluster: a head node and a second node on this machine, each with one
unit of a custom resource `exp` instead of a GPU. The driver keeps the queue, decisions and results.tsv."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.records.ledger import read_results
from autoresearch.views.status import read_status
from autoresearch.session.loop import Loop as ParallelLoop

from test_loop import assert_consistent, cfg, make_repo

pytestmark = pytest.mark.e2e

ray = pytest.importorskip("ray")

# The cluster reports and serves on a loopback address, never the machine's network address. Ray replaces
# 127.0.0.1 (and "localhost") by the address the machine is reached at from outside; another address of the
# loopback network (127.0.0.0/8) it keeps as it is.
LOOPBACK = "127.0.0.2"
FAST_FAILURE = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
                "RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_timeout_ms": "500"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    common = ["--node-ip-address", LOOPBACK, "--num-cpus", "1", "--resources", '{"exp": 1}',
              "--object-store-memory", "80000000", "--disable-usage-stats", "--block"]
    return subprocess.Popen(["ray", "start", *args, *common], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def _stop(p: subprocess.Popen) -> None:
    """Stop a node started here: its whole process group, then reap `ray start` itself."""
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, **FAST_FAILURE, "AR_CACHE": str(tmp / "worker-cache")}
    port = _free_port()
    head = _start(["--head", "--port", str(port), "--include-dashboard", "false"], tmp / "head.log", env)
    nodes = [head]
    try:
        address = f"{LOOPBACK}:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.init(address=address, logging_level="WARNING", log_to_driver=False)
                break
            except Exception:  # noqa: BLE001 — the head is still starting
                if time.monotonic() > deadline or head.poll() is not None:
                    raise
                time.sleep(0.5)
        nodes.append(_start(["--address", address], tmp / "node.log", env))
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            assert time.monotonic() < deadline + 30, (tmp / "node.log").read_text()
            time.sleep(0.2)
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {LOOPBACK}, ray.nodes()
        yield {"address": address, "head": head, "node": nodes[1], "cache": tmp / "worker-cache"}
    finally:
        ray.shutdown()
        for p in reversed(nodes):
            _stop(p)


def _on_node(node: subprocess.Popen) -> list[psutil.Process]:
    """Training processes (train.py) running under a node's process tree."""
    try:
        procs = psutil.Process(node.pid).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in procs if any(a.endswith("train.py") for a in _cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_worker_without_data_fails_once_with_a_clear_message(cluster, tmp_path, prepared_cache):
    assert not (cluster["cache"] / "builtin").exists()     # the driver has the data, the workers do not
    root = make_repo(tmp_path)
    warnings = []
    c = cfg(executor="ray", ray_address=cluster["address"], ray_resource="exp", prepare_data=True, time_budget=1.0)
    with ParallelLoop(c, root, "t", baseline=False, on_event=lambda e: e.kind == "warn" and warnings.append(e)) as lp:
        lp.enqueue_knobs({"DEPTH": 9})
        s = lp.run()
    rows = read_results(root / "runs" / "t" / "results.tsv")
    assert [r.status.value for r in rows] == ["crash"], s
    assert "has no prepared data" in rows[0].reason and "prepare it on every worker" in rows[0].reason
    assert not [w for w in warnings if "sent to the cluster again" in w.message]


@pytest.mark.slow
def test_sweep_across_two_nodes_survives_losing_one(cluster, tmp_path, prepared_cache, tiny_dataset):
    """`ar sweep --executor ray` in its own process, as a user runs it."""
    cluster["cache"].mkdir(parents=True, exist_ok=True)     # the workers' cache gets the shared dataset too
    if not (cluster["cache"] / "builtin").exists():
        (cluster["cache"] / "builtin").symlink_to(tiny_dataset.cache / tiny_dataset.name, target_is_directory=True)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("name: pts\naxes:\n  TOTAL_BATCH_SIZE: [2**17, 2**18, 2**16, 2**19]\norder: listed\n")
    conf = tmp_path / "run.yaml"
    conf.write_text("profile: cpu\nprepare_data: false\ntime_budget: 3\nstartup_allowance: 20\nray_resource: exp\n"
                    "eval_tokens: 2048\nnoise: 0.002\n")

    local = make_repo(tmp_path / "local")
    r = CliRunner().invoke(app, ["sweep", str(sweep), "--repo", str(local), "--config", str(conf), "--gpus", "cpu:2"],
                           terminal_width=200)
    assert r.exit_code == 0, r.output

    remote = make_repo(tmp_path / "remote")
    killed: list[int] = []
    live: list[dict] = []

    def kill_node_mid_task():
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (killed and live):
            slots = ((read_status(remote) or {}).get("status") or {}).get("slots") or []
            if not live and any(s.get("step") and s.get("node") for s in slots):
                live.append({"slots": slots, "out": CliRunner().invoke(app, ["status", "--repo", str(remote)],
                                                                        terminal_width=200).output})
            if not killed and _on_node(cluster["node"]):
                time.sleep(0.5)                     # mid-task: training has started on the second node
                killed.append(cluster["node"].pid)
                os.killpg(cluster["node"].pid, signal.SIGKILL)
            time.sleep(0.1)

    t = threading.Thread(target=kill_node_mid_task)
    t.start()
    r = subprocess.run([sys.executable, "-m", "autoresearch", "sweep", str(sweep), "--repo", str(remote), "--config",
                        str(conf), "--executor", "ray", "--address", cluster["address"]], capture_output=True, text=True,
                       timeout=150)
    t.join()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert killed, "no experiment ever ran on the second node"
    said = " ".join(out.split())
    assert "Ray cluster: 2 exp on 2 node(s)" in said, out
    assert "its Ray worker was lost" in said and "sent to the cluster again (1/3)" in said, out
    assert live, "ar status never showed a Ray slot's step"
    assert "ray slot" in live[0]["out"] and " on " in live[0]["out"] and "step" in live[0]["out"], live[0]["out"]

    def content(root: Path):
        return [(r.description.split(" base=")[0], r.status.value, r.val_bpb, r.knobs.get("TOTAL_BATCH_SIZE"))
                for r in assert_consistent(root, "sweep-pts")]

    assert content(remote) == content(local)
    assert [s for _, s, _, _ in content(remote)] == ["keep", "discard", "discard", "discard"]
    logs = "".join(p.read_text() for p in (remote / "runs" / "sweep-pts").glob("000*/train.log"))
    assert "[ar] ran on Ray node" in logs


@pytest.mark.slow
def test_every_guard_and_stop_rule_alike_on_one_slot_local_slots_and_ray(cluster, tmp_path, prepared_cache,
                                                                           tiny_dataset):
    """One scenario of misbehaving and honest experiments through the inline executor (the repo itself), two
    local worktree slots and the Ray cluster: the same rows, statuses and reasons, whatever runs them."""
    import re

    cluster["cache"].mkdir(parents=True, exist_ok=True)
    if not (cluster["cache"] / "builtin").exists():
        (cluster["cache"] / "builtin").symlink_to(tiny_dataset.cache / tiny_dataset.name, target_is_directory=True)
    scenario = [{"FAIL_MODE": "crash"}, {"FAIL_MODE": "write_tracked"}, {"FAIL_MODE": "lookahead"},
                {"FAIL_MODE": "no_checkpoint"}, {"TOTAL_BATCH_SIZE": 2**18}]
    records = {}
    for name, c in (("inline", cfg()), ("local", cfg(gpus="cpu:2")),      # cfg's 0.5-s budget: 10 steps
                    ("ray", cfg(executor="ray", ray_address=cluster["address"], ray_resource="exp"))):
        root = make_repo(tmp_path / name)
        with ParallelLoop(c, root, "t") as lp:
            for knobs in scenario:
                lp.enqueue_knobs(knobs)
            lp.run()
        records[name] = [(r.exp_id, r.status.value, re.sub(r"[\d.]+", "N", r.reason.split(";")[0]))
                         for r in assert_consistent(root)]
    assert [s for _, s, _ in records["inline"]] == ["keep", "crash", "discard", "rejected", "crash", "keep"]
    assert records["local"] == records["inline"], records
    assert records["ray"] == records["inline"], records
