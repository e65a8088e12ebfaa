"""`ar init DIR`: a workspace for someone who installed the package rather than cloning the repo.

The templates have one source: the checkout's top-level train.py, program.md and configs/. In the checkout,
autoresearch/resources/ holds links to them; building a wheel or an sdist copies what the links reach, so an
installed package carries real files (tests/test_init.py builds a wheel and checks). The package fingerprint
counts those links by where they point, so experiments editing the top-level train.py never move it. An editable
install reads the checkout as it is now: on an autoresearch/* branch that is a tuned train.py, and init says so.
init copies the templates into DIR (train.py and program.md at the top, every YAML file under configs/), ignores
runs/, and makes DIR a git repository with one commit, so that `ar run` can start there at once.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from importlib import resources as importlib_resources
from pathlib import Path

from autoresearch.errors import ArError, GitError

TOP_LEVEL = ("train.py", "program.md")
# results, bytecode, and the README's report outputs: `ar doctor` counts any other untracked file against the repo
GITIGNORE = "runs/\ncheckpoint/\n__pycache__/\n*.pyc\nprogress.png\nresults.json\n"  # checkpoint/: a hand run's


@dataclass(frozen=True)
class Workspace:
    path: Path
    files: list[str]  # relative paths written
    commit: str
    warning: str | None = None   # the templates are not the pristine ones


def _experiment_branch_source(train_py: Path) -> str | None:
    """When train.py is a link into a checkout on an autoresearch/* branch (an editable install), say so."""
    import git

    if not train_py.is_symlink():
        return None
    try:
        repo = git.Repo(train_py.resolve().parent, search_parent_directories=True)
        branch = repo.active_branch.name
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, TypeError):   # TypeError: a detached HEAD
        return None
    if not branch.startswith("autoresearch/"):
        return None
    return (f"the templates come from the checkout {repo.working_tree_dir}, which is on the experiment branch "
            f"{branch}: this train.py is that branch's tuned one (check out main there for the pristine one)")


def packaged_resources() -> Path:
    return Path(str(importlib_resources.files("autoresearch") / "resources"))


def plan(resources: Path) -> dict[str, Path]:
    """Relative destination -> source file, for what the resources folder holds."""
    files = {name: resources / name for name in TOP_LEVEL}
    missing = [name for name, src in files.items() if not src.is_file()]
    if missing:
        raise ArError(f"this installation of ar has no packaged {', '.join(missing)} (looked in {resources}); "
                      "reinstall it (pip install --force-reinstall autoresearch-ar) or clone the repository")
    for folder, _, names in sorted(os.walk(resources, followlinks=True)):
        for name in sorted(names):
            src = Path(folder) / name
            if src.suffix in (".yaml", ".yml") and src.is_file():
                rel = src.relative_to(resources)
                if rel == Path("gpus.yaml"):     # the GPU table is read from the package (override: ar doctor)
                    continue
                rel = rel.relative_to("configs") if rel.parts[0] == "configs" else rel
                files.setdefault(str(Path("configs") / rel), src)
    return files


def init_workspace(target: str | Path, *, force: bool = False, resources: Path | None = None) -> Workspace:
    """Create the workspace at `target`; refuse a non-empty directory unless `force`."""
    import git

    target = Path(target).expanduser().resolve()
    if target.exists() and not target.is_dir():
        raise ArError(f"{target} is a file; pick a directory path for the workspace")
    if target.exists() and any(target.iterdir()) and not force:
        raise ArError(f"{target} is not empty; pick a new or empty directory (or pass --force to write into it)")
    files = plan(resources or packaged_resources())
    warning = _experiment_branch_source(files["train.py"])
    target.mkdir(parents=True, exist_ok=True)
    for rel, src in files.items():
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)  # follows the repo's symlinks: the workspace gets real files
    gitignore = target / ".gitignore"
    if not gitignore.exists() or "runs/" not in gitignore.read_text().split():
        with gitignore.open("a") as f:
            f.write(GITIGNORE)
    written = sorted(files) + [".gitignore"]
    try:
        repo = git.Repo(target) if (target / ".git").exists() else git.Repo.init(target)
        repo.index.add([str(target / rel) for rel in written])
        cfg = repo.config_reader()
        who = None if cfg.has_option("user", "name") and cfg.has_option("user", "email") else git.Actor(
            "ar", "ar@localhost")   # the user's identity when git has one, not the host's guessed root@hostname
        commit = repo.index.commit("Workspace created by ar init", author=who, committer=who).hexsha
    except git.GitCommandError as e:
        raise GitError(f"could not make {target} a git repository: {e.stderr.strip() or e}") from None
    return Workspace(target, written, commit, warning)
