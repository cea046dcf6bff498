"""A git worktree of an older revision, for the benches' ``--before REV`` comparisons, and what each side ran.

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

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def revision_tree(rev: str, prefix: str = "bench-before-") -> Iterator[Path]:
    """Yield a detached worktree of ``rev`` (any git revision, or a ``.patch`` file: this checkout's HEAD with the
    patch applied) in a fresh temporary folder; remove it afterwards."""
    patch = Path(rev).resolve() if rev.endswith(".patch") else None
    work = Path(tempfile.mkdtemp(prefix=prefix))
    tree = work / "tree"
    # git says "HEAD is now at ..." on stdout: sent to stderr, as the benches write their JSON on stdout
    added = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), "HEAD" if patch else rev],
        stdout=subprocess.PIPE,
    )
    sys.stderr.write(added.stdout.decode(errors="replace"))
    if added.returncode:
        shutil.rmtree(work, ignore_errors=True)
        raise subprocess.CalledProcessError(added.returncode, added.args)
    try:
        if patch:
            subprocess.run(["git", "-C", str(tree), "apply", str(patch)], check=True)
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
    """``rev`` as ``<short hash> <subject>`` (for the reports); a patch as ``HEAD + NAME.patch``."""
    if rev.endswith(".patch"):
        return f"{describe('HEAD')} + {Path(rev).name}"
    result = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%h %s", rev], capture_output=True, text=True, check=False
    )
    return result.stdout.strip() or rev


@contextmanager
def code_trees(before: str | None, label: str = "after") -> Iterator[list[tuple[str, Path | None]]]:
    """[(label, None)] (this checkout), or with ``before`` [("before", worktree of REV), ("after", None)]: the
    benches alternate them within one run, so both see the same machine state."""
    if not before:
        yield [(label, None)]
        return
    with revision_tree(before, prefix="served-bench-before-") as old:
        yield [("before", old), ("after", None)]


def in_turn(items: list, round_index: int) -> list:
    """``items`` (code trees, or the servers serving them) in the order of round ``round_index``: as given in even
    rounds, reversed in odd ones, so that no tree is always measured first."""
    return items[::-1] if round_index % 2 else list(items)


def revision_info(before: str | None, label: str = "after") -> dict:
    """What each label's runs served: this checkout (its HEAD, and whether elmo/ or service/ have local changes),
    and the --before revision."""
    head = subprocess.run(["git", "-C", str(REPO), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "elmo", "service"], capture_output=True, text=True
    )
    info = {
        label if not before else "after": f"working tree on {head.stdout.strip()}"
        + (" (modified)" if dirty.stdout.strip() else "")
    }
    if before:
        info["before"] = describe(before)
    return info
