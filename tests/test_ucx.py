"""_native.ucx_available(): whether the UCX plugin and UCX load, and why not.

The loader decides once per process, so each case runs in a fresh
interpreter with its own environment."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from datadist_aio import _native

PLUGIN = Path(_native.__file__).resolve().parent / "libdatadist_ucx.so"
PROBE = "import json; from datadist_aio import _native; print(json.dumps(_native.ucx_available()))"


def _available(**env: str) -> tuple[bool, str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DATADIST_AIO_UCX_")}
    full.update(env)
    out = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ok, why = json.loads(out.stdout.strip().splitlines()[-1])
    return ok, why


def _system_ucx() -> bool:
    try:
        ctypes.CDLL("libucp.so.0")
    except OSError:
        return False
    return True


def test_a_missing_plugin_says_where_it_looked(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "libdatadist_ucx.so"
    ok, why = _available(DATADIST_AIO_UCX_PLUGIN=str(missing))
    assert not ok
    assert why.startswith("UCX not found: there is no UCX plugin at " + str(missing))
    assert "libucx-cu12" in why and "libucx-dev" in why


def test_a_named_ucx_folder_without_ucx_says_so(tmp_path: Path) -> None:
    if not PLUGIN.exists():
        pytest.skip("this build has no UCX plugin (UCX's headers were not found when it was built)")
    ok, why = _available(DATADIST_AIO_UCX_LIB_DIR=str(tmp_path))
    assert not ok
    assert why == f"UCX not found: $DATADIST_AIO_UCX_LIB_DIR names {tmp_path}, which has no libucp.so.0"


def test_the_default_answer_matches_what_is_installed() -> None:
    ok, why = _available()
    if not PLUGIN.exists():
        assert not ok
        assert why.startswith(f"UCX not found: there is no UCX plugin at {PLUGIN}")
    elif _system_ucx():
        assert ok, why
        assert why.startswith("UCX 1.") and why.endswith(f"plugin {PLUGIN}")
        assert "the system's libucp.so.0" in why
    else:
        # Without a system UCX the libucx-cu12 wheel beside the package is used, if any.
        assert ok == (PLUGIN.parent.parent / "libucx" / "lib" / "libucp.so.0").exists(), why


def test_ucx_from_the_libucx_wheel() -> None:
    if not PLUGIN.exists():
        pytest.skip("this build has no UCX plugin (UCX's headers were not found when it was built)")
    try:
        import libucx  # type: ignore[import-not-found]  # the ucx extra: libucx-cu12
    except ImportError:
        pytest.skip("the libucx-cu12 wheel is not installed (pip install 'datadist_aio[ucx]')")
    folder = Path(libucx.__file__).resolve().parent / "lib"
    ok, why = _available(DATADIST_AIO_UCX_LIB_DIR=str(folder))
    assert ok, why
    assert why.startswith("UCX 1.") and f" from {folder}, plugin {PLUGIN}" in why
