"""What must not change during a session: the installed package (the harness and the evaluator in it) and the
prepared data. Fingerprinted at session start; compared after every proposal (the agent runs unsandboxed),
after every run, and before every evaluation.

- the package: sha256 of every file under autoresearch/, __pycache__ included (a poisoned .pyc whose header
  matches its source would be loaded by Python; this process writes no bytecode, so any change is foreign).
  A link counts by where it points, not by what it reaches: in a checkout the init templates under resources/
  are links to the top-level train.py, program.md and configs/, which experiments edit and nothing here runs;
  pointing a link elsewhere, or replacing one, still changes the fingerprint;
- the evaluation data (validation split, token-bytes table, tokenizer, meta.json): sha256 of the contents —
  the evaluator checks these again itself;
- the training split, which may be large: size, mtime, ctime and inode (a write, a chmod or a utime always moves
  ctime, which user space cannot set back).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from autoresearch.harness.data import TRAIN_FILES
from autoresearch.harness.evaluator import manifest

PACKAGE_DIR = Path(__file__).resolve().parent


def package_digest(root: Path) -> dict[str, str]:
    out = {}
    for folder, dirs, files in os.walk(root):      # links to folders stay in dirs, unfollowed
        for name in dirs + files:
            f = Path(folder) / name
            if f.is_symlink():
                out[str(f.relative_to(root))] = "link:" + os.readlink(f)
            elif f.is_file():
                out[str(f.relative_to(root))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _train_sig(tok_dir: Path) -> dict[str, tuple]:
    out = {}
    for name in TRAIN_FILES:
        try:
            st = (Path(tok_dir) / name).stat()
            out[name] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        except OSError:
            out[name] = None
    return out


@dataclass(frozen=True)
class Fingerprint:
    package: dict[str, str]
    eval_files: dict[str, str]        # the evaluator's manifest
    train_files: dict[str, tuple]
    tok_dir: Path | None
    package_dir: Path

    @classmethod
    def take(cls, tok_dir: Path | None, package_dir: Path | None = None) -> "Fingerprint":
        package_dir = package_dir or PACKAGE_DIR
        return cls(package_digest(package_dir), manifest(tok_dir) if tok_dir else {},
                   _train_sig(tok_dir) if tok_dir else {}, tok_dir, package_dir)

    def changes(self, *, hash_eval: bool = True) -> str | None:
        """What changed since this fingerprint was taken, in one line, or None."""
        now = package_digest(self.package_dir)
        for name in sorted(set(now) | set(self.package)):
            if now.get(name) != self.package.get(name):
                verb = "appeared in" if name not in self.package else "vanished from" if name not in now else \
                    "changed in"
                return f"{name} {verb} the installed package {self.package_dir}"
        if self.tok_dir is None:
            return None
        if _train_sig(self.tok_dir) != self.train_files:
            return f"the training data in {self.tok_dir} changed"
        if hash_eval:
            try:
                now_eval = manifest(self.tok_dir)
            except OSError as e:
                return f"the evaluation data in {self.tok_dir} is unreadable: {e.strerror or e}"
            for name, digest in self.eval_files.items():
                if now_eval.get(name) != digest:
                    return f"{name} in {self.tok_dir} changed (the evaluation data)"
        return None


def no_bytecode() -> None:
    """This process writes no .pyc, so the package fingerprint only moves when something else changes it."""
    import sys
    sys.dont_write_bytecode = True
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
