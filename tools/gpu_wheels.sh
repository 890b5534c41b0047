#!/usr/bin/env bash
# Downloads into .whl/ (ignored by git) the pure-Python wheels that
# tools/gpu_check.sh installs on a GPU machine without a package index:
# the test runner and its asyncio plugin, and the build's pybind11 and
# scikit-build-core. Run where pip reaches an index.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-asyncio==1.5.0 pytest-timeout==2.4.0 \
  'pybind11>=3,<4' 'scikit-build-core>=0.10'
ls -1 .whl
