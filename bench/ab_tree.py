"""The `meld` package of an A/B side: a tree holding another commit's package, put first on the path.

A tree that is not there must stop the run: with the path entry missing, `import meld` would quietly find
this checkout's package and the A/B would compare the code with itself. (Trees under an ignored folder such
as `.ab/` reach the GPU machine only when the run carries them.)
"""
from __future__ import annotations

import sys
from pathlib import Path


def worker_tree_first(repo: Path) -> None:
    """In a worker process (`--worker TREE` on the command line), import `meld` from TREE before anything
    else imports it: a module imported once is never looked up again, so this must run before the
    script imports any of `bench` that uses meld."""
    if "--worker" in sys.argv:
        use_tree(Path(sys.argv[sys.argv.index("--worker") + 1]), repo)


def use_tree(tree: Path, repo: Path) -> None:
    """Import `meld` from `tree` (then `repo` for `bench`); exit naming the tree if it has no package."""
    init = Path(tree) / "meld" / "__init__.py"
    if not init.is_file():
        raise SystemExit(f"{tree}: no meld package there ({init} is missing; was the tree carried?)")
    sys.path[:0] = [str(tree), str(repo)]
    import meld

    if Path(meld.__file__).resolve() != init.resolve():
        raise SystemExit(f"{tree}: `import meld` found {meld.__file__} instead")
