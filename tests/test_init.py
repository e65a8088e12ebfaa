"""ar init: a workspace from the packaged resources, committed, refusing to overwrite; the templates themselves.
(A run in a new workspace: test_first_hour.test_the_quick_start_in_a_new_workspace.)"""

from pathlib import Path

import git
import pytest
from typer.testing import CliRunner

from autoresearch.cli import app
from autoresearch.errors import ArError
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


def test_init_commits_as_ar_when_git_has_no_identity(tmp_path, resources, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))               # no ~/.gitconfig: no user.name
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "home" / ".config"))
    init_workspace(tmp_path / "ws", resources=resources)
    c = git.Repo(tmp_path / "ws").head.commit
    assert (c.author.name, c.author.email, c.committer.email) == ("ar", "ar@localhost", "ar@localhost")


def test_init_refuses_a_non_empty_directory_unless_forced(tmp_path, resources):
    target = tmp_path / "busy"
    target.mkdir()
    (target / "mine.txt").write_text("keep me\n")
    with pytest.raises(ArError, match="not empty.*--force"):
        init_workspace(target, resources=resources)
    assert not (target / "train.py").exists()
    init_workspace(target, resources=resources, force=True)
    assert (target / "mine.txt").read_text() == "keep me\n" and (target / "train.py").exists()


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


def _files(folder: Path) -> set[str]:
    return {str(f.relative_to(folder)) for f in folder.rglob("*") if f.is_file()}


def test_the_packaged_templates_are_real_files_equal_to_the_checkouts():
    """The templates are real files (a link would give init the checkout's current train.py, and put a file every
    proposal edits inside the fingerprinted package), and on main they equal the top-level copies byte for byte."""
    res = packaged_resources()
    for name in ("train.py", "program.md", "configs"):
        assert not (res / name).is_symlink(), f"{res / name} is a link; ship a real copy"
    branch = _checkout_branch()
    if branch is None or not (ROOT / "train.py").is_file():
        pytest.skip("not run from a checkout: nothing to compare the templates with")
    if branch.startswith("autoresearch/"):
        pytest.skip(f"the checkout is on the experiment branch {branch}, where train.py is meant to differ")
    for name in ("train.py", "program.md"):
        assert (res / name).read_bytes() == (ROOT / name).read_bytes(), (
            f"{name} and autoresearch/resources/{name} differ: copy the one you changed over the other")
    assert _files(res / "configs") == _files(ROOT / "configs")
    for rel in _files(ROOT / "configs"):
        assert (res / "configs" / rel).read_bytes() == (ROOT / "configs" / rel).read_bytes(), (
            f"configs/{rel} and autoresearch/resources/configs/{rel} differ: copy the one you changed over the other")


def test_cli_init_prints_the_next_commands(tmp_path):
    result = runner.invoke(app, ["init", str(tmp_path / "ws")])
    assert result.exit_code == 0, result.output
    assert f"cd {tmp_path / 'ws'} && ar run --max-experiments 6" in result.output and "ar report" in result.output
    assert (tmp_path / "ws" / "train.py").read_bytes() == (packaged_resources() / "train.py").read_bytes()
    assert not (tmp_path / "ws" / "configs" / "gpus.yaml").exists()   # read from the package, not copied
    again = runner.invoke(app, ["init", str(tmp_path / "ws")])
    assert again.exit_code == 1 and "not empty" in str(again.exception)
