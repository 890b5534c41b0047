"""_native.ucx_available(): whether the UCX plugin and UCX load, and why not.

The loader decides once per process, so each case runs in a fresh
interpreter with its own environment."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

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


def _loader() -> Optional[str]:
    """The dynamic loader of this process (ld-linux-*.so.*), from its mappings."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if os.path.basename(path).startswith("ld-") and ".so" in path:
                return path
    return None


def _loader_search_path() -> list[str]:
    """Where ``dlopen("libucp.so.0")`` from the package looks, in order (the
    extension has no RPATH or RUNPATH): the folders the dynamic loader names
    (``ld.so --help``: $LD_LIBRARY_PATH's, then its cache's entries, marked
    "ld.so.cache" here, then its default folders), else the same from
    $LD_LIBRARY_PATH, ``ldconfig -p`` and the usual default folders."""
    loader = _loader()
    if loader is not None:
        shown = subprocess.run([loader, "--help"], capture_output=True, text=True, timeout=30).stdout
        folders = shown.partition("Shared library search path:\n")[2].partition("\n\n")[0].splitlines()
        if folders:
            return ["ld.so.cache" if "ld.so.cache" in f else f.strip().rsplit(" (", 1)[0] for f in folders]
    multiarch = f"{os.uname().machine}-linux-gnu"
    return [*filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")), "ld.so.cache",
            f"/lib/{multiarch}", f"/usr/lib/{multiarch}", "/lib64", "/usr/lib64", "/lib", "/usr/lib"]


def _loadable(path: str) -> bool:
    """An ELF file of this interpreter's class and machine (a file made empty
    or unreadable, as tools/without_system_ucx.sh hides one, is not)."""
    try:
        with open(path, "rb") as lib, open(sys.executable, "rb") as own:
            theirs, ours = lib.read(20), own.read(20)
    except OSError:
        return False
    return theirs[:4] == b"\x7fELF" and (theirs[4], theirs[18:20]) == (ours[4], ours[18:20])


def _system_ucx() -> bool:
    """Whether the system has a libucp.so.0 that the loader finds by name,
    decided from the loader's search path, not by loading it: once this
    process has loaded the libucx-cu12 wheel's libucp.so.0 (an earlier
    test's engine did), ``dlopen("libucp.so.0")`` answers with that one."""
    for folder in _loader_search_path():
        if folder == "ld.so.cache":
            ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
            try:
                cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
            except OSError:
                continue
            found = [line.rpartition(" => ")[2].strip() for line in cache.splitlines()
                     if line.strip().startswith("libucp.so.0 ")]
        else:
            found = [os.path.join(folder or ".", "libucp.so.0")]
        if any(_loadable(path) for path in found):
            return True
    return False


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


def test_the_system_ucx_is_what_a_fresh_process_loads() -> None:
    """_system_ucx() agrees with ``dlopen("libucp.so.0")`` in a fresh process
    whatever this one has loaded: the libucx-cu12 wheel's UCX, where it is
    installed, is loaded here first, by path, as the engine loads it where
    the system has none (beside the system's, already loaded here by an
    earlier test, it does not load: its symbols are not the older UCX's)."""
    wheel = PLUGIN.parent.parent / "libucx" / "lib" / "libucp.so.0"
    if wheel.exists():
        try:
            ctypes.CDLL(str(wheel), mode=os.RTLD_LOCAL)
        except OSError:
            pass
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATADIST_AIO_UCX_")}
    fresh = subprocess.run([sys.executable, "-c", "import ctypes; ctypes.CDLL('libucp.so.0')"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert _system_ucx() == (fresh.returncode == 0), fresh.stderr


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
