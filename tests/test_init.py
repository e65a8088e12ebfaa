"""ar init: a workspace from the packaged resources, committed, refusing to overwrite; the templates themselves;
and the README's quick start in a new workspace through the real command line (init, run, report --plot)."""

import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.errors import ArError
from autoresearch.trust.integrity import Fingerprint
from autoresearch.knobs import set_knobs
from autoresearch.records.ledger import Status, read_results
from autoresearch.workspace import init_workspace, packaged_resources

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture
def resources(tmp_path):
    """A resources folder shaped like the package's: files at the top, configs behind a directory link."""
    res, configs = tmp_path / "res", tmp_path / "configs-src"
    res.mkdir()
    configs.mkdir()
    (res / "train.py").write_text("print('train')\n")
    (res / "program.md").write_text("# program\n")
    (res / "gpus.yaml").write_text("- {name: X, match: [x], tflops: 1}\n")
    (res / "notes.txt").write_text("not a config\n")
    (configs / "sweep-small.yaml").write_text("grid: {}\n")
    (res / "configs").symlink_to(configs, target_is_directory=True)
    return res


@pytest.mark.integration
def test_init_creates_a_committed_workspace(tmp_path, resources):
    ws = init_workspace(tmp_path / "ws", resources=resources)
    root = tmp_path / "ws"
    assert sorted(ws.files) == [".gitignore", "configs/sweep-small.yaml", "program.md", "train.py"]
    assert (root / "train.py").read_text() == "print('train')\n" and not (root / "train.py").is_symlink()
    assert "runs/" in (root / ".gitignore").read_text().split()
    repo = git.Repo(root)
    assert not repo.is_dirty(untracked_files=True)
    assert [c.hexsha for c in repo.iter_commits()] == [ws.commit]
    assert sorted(repo.git.ls_files().split()) == sorted(ws.files)
    assert repo.head.commit.author.email in ("ar@localhost", repo.config_reader().get_value("user", "email", ""))


@pytest.mark.integration
def test_init_commits_as_ar_when_git_has_no_identity(tmp_path, resources, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))               # no ~/.gitconfig: no user.name
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    init_workspace(tmp_path / "ws", resources=resources)
    c = git.Repo(tmp_path / "ws").head.commit
    assert (c.author.name, c.author.email, c.committer.email) == ("ar", "ar@localhost", "ar@localhost")


@pytest.mark.integration
def test_init_refuses_a_non_empty_directory_unless_forced(tmp_path, resources):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "mine.txt").write_text("keep me\n")
    with pytest.raises(ArError, match="not empty.*--force"):
        init_workspace(target, resources=resources)
    assert not (target / "train.py").exists()
    init_workspace(target, resources=resources, force=True)
    assert (target / "mine.txt").read_text() == "keep me\n" and (target / "train.py").exists()


@pytest.mark.integration
def test_init_into_an_existing_empty_directory_and_not_a_file(tmp_path, resources):
    (tmp_path / "empty").mkdir()
    init_workspace(tmp_path / "empty", resources=resources)
    (tmp_path / "file").write_text("")
    with pytest.raises(ArError, match="is a file"):
        init_workspace(tmp_path / "file", resources=resources)


def test_init_without_packaged_files(tmp_path, resources):
    (resources / "program.md").unlink()
    with pytest.raises(ArError, match="no packaged program.md"):
        init_workspace(tmp_path / "ws", resources=resources)
    assert not (tmp_path / "ws").exists()


def _checkout_branch() -> str | None:
    """The branch of the checkout these tests run from; "" when detached; None when there is no checkout."""
    try:
        repo = git.Repo(ROOT)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return None
    try:
        return repo.active_branch.name
    except TypeError:
        return ""


def test_the_packaged_templates_are_links_to_the_checkouts_top_level_files():
    """One source for the templates: in a checkout, resources/ links to the top-level files."""
    res = ROOT / "autoresearch" / "resources"
    if _checkout_branch() is None or not (ROOT / "train.py").is_file():
        pytest.skip("not run from a checkout")
    for name in ("train.py", "program.md", "configs"):
        assert (res / name).is_symlink() and (res / name).resolve() == (ROOT / name).resolve(), name


def _setuptools_major() -> int:
    try:
        import setuptools
    except ImportError:
        return 0
    return int(setuptools.__version__.split(".")[0])


@pytest.mark.integration
def test_a_built_wheel_carries_real_copies_of_the_templates(tmp_path):
    """What pip installs from a checkout: the links become files equal to the top-level ones."""
    if _checkout_branch() is None or not (ROOT / "pyproject.toml").is_file():
        pytest.skip("not run from a checkout")
    src = tmp_path / "src"
    git.Repo(ROOT).git.worktree("add", "--detach", str(src), "HEAD")   # the committed tree, not the work tree
    try:
        # the installed build backend when it is recent enough (seconds faster); else pip fetches one
        isolation = ["--no-build-isolation"] if _setuptools_major() >= 68 else []
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                        "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
        wheel, = (tmp_path / "dist").glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            inside = {i.filename: i for i in z.infolist()}
            for rel in ["train.py", "program.md"] + [f"configs/{f.name}" for f in (src / "configs").glob("*.yaml")]:
                info = inside[f"autoresearch/resources/{rel}"]
                assert not stat.S_ISLNK(info.external_attr >> 16), f"{rel} is a link in the wheel"
                assert z.read(info) == (src / rel).read_bytes(), rel
    finally:
        git.Repo(ROOT).git.worktree("remove", "--force", str(src))


def test_editing_the_checkouts_train_py_leaves_the_package_fingerprint_alone(tmp_path):
    """The links count by where they point: an experiment's edit is not a change to the package; relinking is."""
    pkg = tmp_path / "pkg"
    (pkg / "resources").mkdir(parents=True)
    (pkg / "harness.py").write_text("X = 1\n")
    (tmp_path / "train.py").write_text("print('baseline')\n")
    (tmp_path / "other.py").write_text("print('other')\n")
    (pkg / "resources" / "train.py").symlink_to("../../train.py")
    fp = Fingerprint.take(None, pkg)
    (tmp_path / "train.py").write_text("print('an experiment')\n")
    assert fp.changes() is None
    (pkg / "resources" / "train.py").unlink()
    (pkg / "resources" / "train.py").symlink_to("../../other.py")
    assert "resources/train.py changed" in fp.changes()
    (pkg / "resources" / "train.py").unlink()
    (pkg / "resources" / "train.py").write_text("print('baseline')\n")
    assert "resources/train.py changed" in fp.changes()


@pytest.mark.integration
def test_init_from_a_checkout_on_an_experiment_branch_says_the_train_py_is_tuned(tmp_path):
    checkout = tmp_path / "checkout"
    repo = git.Repo.init(checkout)
    (checkout / "train.py").write_text("print('tuned')\n")
    (checkout / "program.md").write_text("# program\n")
    res = checkout / "autoresearch" / "resources"
    res.mkdir(parents=True)
    for name in ("train.py", "program.md"):
        (res / name).symlink_to(f"../../{name}")
    actor = git.Actor("t", "t@localhost")
    repo.index.add(["train.py", "program.md"])
    repo.index.commit("base", author=actor, committer=actor)
    assert init_workspace(tmp_path / "on-main", resources=res).warning is None
    repo.git.checkout("-b", "autoresearch/dec01")
    ws = init_workspace(tmp_path / "on-branch", resources=res)
    assert "autoresearch/dec01" in ws.warning and "tuned" in ws.warning
    assert (ws.path / "train.py").read_text() == "print('tuned')\n" and not (ws.path / "train.py").is_symlink()


@pytest.mark.integration
def test_cli_init_prints_the_next_commands(tmp_path):
    result = runner.invoke(app, ["init", str(tmp_path / "ws")])
    assert result.exit_code == 0, result.output
    assert f"cd {tmp_path / 'ws'} && ar run --max-experiments 6" in result.output and "ar report" in result.output
    assert (tmp_path / "ws" / "train.py").read_bytes() == (packaged_resources() / "train.py").read_bytes()
    assert not (tmp_path / "ws" / "configs" / "gpus.yaml").exists()   # read from the package, not copied
    again = runner.invoke(app, ["init", str(tmp_path / "ws")])
    assert again.exit_code == 1 and "not empty" in str(again.exception)


# --------------------------------------------------------------------------------- the quick start in a new workspace

def ar(*args, cwd):
    return subprocess.run([sys.executable, "-m", "autoresearch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.e2e
@pytest.mark.slow
def test_the_quick_start_in_a_new_workspace(tmp_path, prepared_cache):
    """The README's quick start through the real command line: `ar init X && cd X && ar run --max-experiments N`
    from an empty folder, then `ar report --plot`. Small: the shared tiny dataset linked as `builtin`, a 3-s
    budget, the baseline and one proposal (each run costs ~30 s of start-up and evaluation on 2 busy cores, so
    the noise calibration, tested in test_loop, is left out here)."""
    init = ar("init", "myrun", cwd=tmp_path)
    assert init.returncode == 0, init.stdout + init.stderr
    assert "cd myrun && ar run --max-experiments 6" in init.stdout, init.stdout
    ws = tmp_path / "myrun"
    assert (ws / "train.py").read_bytes() == (packaged_resources() / "train.py").read_bytes()
    # 16x smaller steps (2 rows of 256 tokens): a 3-s budget's last step must fit ar's fixed last-step slack even
    # on a CPU shared with other tests, where a default-size step can take longer than that slack
    set_knobs(ws / "train.py", {"TOTAL_BATCH_SIZE": 2**15})
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "small steps"], cwd=ws,
                   check=True)
    (tmp_path / "noise.yaml").write_text("noise: 0.05\n")   # a stated threshold: no calibration runs here
    r = subprocess.run([sys.executable, "-m", "autoresearch", "run", "--max-experiments", "2", "--time-budget", "3",
                        "--config", str(tmp_path / "noise.yaml")], cwd=ws, capture_output=True, text=True, timeout=540,
                       env={k: v for k, v in os.environ.items() if k != "AR_PROFILE"})
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert "stopped: reached --max-experiments 2" in out and "best: " in out, out
    [results] = ws.glob("runs/*/results.tsv")
    rows = read_results(results)
    assert [r.description.split(":")[0] for r in rows] == ["baseline", "strategy"], rows   # a proposal committed
    assert rows[0].status is Status.KEEP and rows[0].val_bpb is not None
    plot = ar("report", "--plot", "progress.png", cwd=ws)
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert "best:" in plot.stdout and (ws / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ws, capture_output=True, text=True, check=True)
    assert status.stdout == ""          # clean: train.py is the best's, and the plot is ignored (doctor would warn)
