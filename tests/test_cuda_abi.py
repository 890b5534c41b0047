"""The engine's declarations of the CUDA driver API, and the driver stand-in
the device tests run on, checked against NVIDIA's own cuda.h.

The header comes from the ``nvidia-cuda-runtime-cu12`` wheel (CI installs
it: ``pip install nvidia-cuda-runtime-cu12``) or from the directory named by
``$DATADIST_CUDA_INCLUDE_DIR``; without either the checks are skipped. Each
check is a compilation that fails on the first type, value or signature that
differs (``tests/cuda_abi/check_cuda_abi.cpp``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent


def cuda_include_dir() -> Optional[Path]:
    named = os.environ.get("DATADIST_CUDA_INCLUDE_DIR")
    if named:
        return Path(named)
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:  # no nvidia package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        include = Path(location) / "include"
        if (include / "cuda.h").is_file():
            return include
    return None


INCLUDE = cuda_include_dir()
# CI sets DATADIST_REQUIRE_CUDA_H=1: there a missing header fails the checks instead of skipping them.
pytestmark = pytest.mark.skipif(
    INCLUDE is None and os.environ.get("DATADIST_REQUIRE_CUDA_H") != "1",
    reason="no cuda.h: pip install nvidia-cuda-runtime-cu12, or set DATADIST_CUDA_INCLUDE_DIR",
)


def compile_check(compiler: str, source: Path, *flags: str) -> None:
    assert INCLUDE is not None, "no cuda.h (DATADIST_REQUIRE_CUDA_H=1)"
    if shutil.which(compiler) is None:
        pytest.skip(f"no {compiler}")
    command = [compiler, "-fsyntax-only", "-Wall", "-Wextra", f"-I{INCLUDE}", *flags, str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stderr}"


def test_the_engines_driver_declarations_match_cuda_h() -> None:
    compile_check("g++", ROOT / "tests/cuda_abi/check_cuda_abi.cpp", "-std=c++17",
                  f"-I{ROOT / 'native/src'}", f"-I{ROOT / 'native/include'}")


def test_the_driver_stand_in_defines_every_entry_point_as_cuda_h_declares_it() -> None:
    compile_check("cc", ROOT / "tests/cuda_standin/standin_cuda.c", "-std=gnu11", "-DSTANDIN_WITH_CUDA_H")
