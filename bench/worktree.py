"""A git worktree of an older revision, for the benches' ``--before REV`` comparisons.

    with revision_tree("5ad4e74") as old:        # a detached checkout of 5ad4e74 in a temporary folder
        subprocess.run([sys.executable, "-m", "elmo.cli", ...], cwd=old, env=tree_env(old))

The tree is removed afterwards (``git worktree remove --force``) whatever happens. It holds only what git tracks:
ignored files (data/, runs/, .venv) are not there, so run it with this tree's interpreter (``sys.executable``) and
``tree_env``, which puts the old tree first on the import path (ahead of this checkout's editable install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def revision_tree(rev: str, prefix: str = "bench-before-") -> Iterator[Path]:
    """Yield a detached worktree of ``rev`` (any git revision) in a fresh temporary folder; remove it afterwards."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    tree = work / "tree"
    # git says "HEAD is now at ..." on stdout: sent to stderr, as the benches write their JSON on stdout
    added = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], stdout=subprocess.PIPE
    )
    sys.stderr.write(added.stdout.decode(errors="replace"))
    if added.returncode:
        shutil.rmtree(work, ignore_errors=True)
        raise subprocess.CalledProcessError(added.returncode, added.args)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)


def tree_env(tree: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process that must import ``tree``'s packages (elmo, service, bench), not this one's."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH", "")])])
    return env


def describe(rev: str) -> str:
    """``rev`` as ``<short hash> <subject>`` (for the reports)."""
    result = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%h %s", rev], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or rev


__all__ = ["REPO", "describe", "revision_tree", "tree_env"]
