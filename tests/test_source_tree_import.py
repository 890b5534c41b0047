"""Importing datadist_aio from a source tree that has no built extension
says so and how to fix it, instead of failing somewhere inside the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import datadist_aio

PACKAGE = Path(datadist_aio.__file__).resolve().parent


def _import_from(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # -I: no user site, no PYTHONPATH, no script folder; the source tree's
    # root is put first, as the current directory is with `python -m`.
    code = f"import sys; sys.path.insert(0, {str(root)!r}); import datadist_aio"
    return subprocess.run([sys.executable, "-I", *flags, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_source_tree_without_its_build_says_so(tmp_path: Path) -> None:
    tree = tmp_path / "clone"
    shutil.copytree(PACKAGE, tree / "datadist_aio", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # -S: no site-packages, so neither an installed datadist_aio nor an
    # editable install's finder supplies the extension (.ci/run checks the
    # same with a regular install beside a clone).
    out = _import_from(tree, "-S")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: datadist_aio's native extension (_native) is not built in "
                           f"{tree / 'datadist_aio'}"), out.stderr
    assert "pip install -e ." in last and "run from another directory" in last
    assert "partially initialized" not in out.stderr


def test_the_installed_package_imports_from_elsewhere(tmp_path: Path) -> None:
    out = _import_from(tmp_path)
    assert out.returncode == 0, out.stderr
