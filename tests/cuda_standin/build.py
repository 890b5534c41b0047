"""Builds the stand-in CUDA driver (libcuda.so.1) with the C compiler, no CMake.

    from cuda_standin.build import build
    library = build(tmp_dir)  # tmp_dir / "libcuda.so.1"

It is rebuilt only when a source file is newer than the library.

``soname`` links a copy under another name. Once a library whose soname is
libcuda.so.1 is loaded, every later dlopen("libcuda.so.1") in that process
gets it; a test process that loads the stand-in itself, beside code that
looks for a real driver by that name, loads such a copy instead.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "standin_cuda.c", HERE / "standin_cuda_types.h")
LIBRARY_NAME = "libcuda.so.1"

FLAGS = (
    "-std=c11",
    "-O2",
    "-g",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fvisibility=hidden",
)


def build(out_dir: Path, soname: str = LIBRARY_NAME) -> Path:
    """Compiles the library into out_dir / soname (unless it is up to date)
    and returns its path."""
    if "/" in soname or not soname:
        raise ValueError(f"not a library name: {soname!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / soname
    newest = max(source.stat().st_mtime_ns for source in SOURCES)
    if library.exists() and library.stat().st_mtime_ns >= newest:
        return library
    compiler = shlex.split(os.environ.get("CC") or next(
        (name for name in ("cc", "gcc", "clang") if shutil.which(name)), "cc"))
    # Built under a name of its own, then renamed: a reader never sees half a file.
    partial = out_dir / f".{soname}.{os.getpid()}.tmp"
    command = [*compiler, *FLAGS, f"-Wl,-soname,{soname}", "-o", str(partial), str(SOURCES[0])]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building the stand-in CUDA driver failed: {shlex.join(command)}\n{done.stderr}")
    os.replace(partial, library)
    return library


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path.cwd()))
