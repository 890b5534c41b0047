#!/usr/bin/env bash
# The installs the README gives, as a new user meets them: a clean clone of
# the committed tree and fresh venvs under build/install-check, with no UCX
# headers on the system (where it has them they are hidden from these builds:
# as root, in a mount namespace of this script's own).
#   - With the pip a fresh venv brings, pip install '.[ucx]': the UCX plugin
#     is built against the libucx-cu12 wheel's headers, and
#     `python -m datadist_aio demo --transport ucx` moves bytes over UCX and
#     checks every one, on the UCX the loader finds first (the system's where
#     it has one) and on the wheel's, with no warning from UCX; importing from
#     the clone's root says that the extension is not built there and how to
#     fix it.
#   - With the newest pip, pip install -e . then the ucx extra: the same demo.
# Usage: tools/check_installs.sh [git-repository] (default: this one's HEAD).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source_repo="${1:-$root}"
work="$root/build/install-check"

if [ -z "${DATADIST_INSTALLS_HIDDEN:-}" ] && ls /usr/include/ucp /usr/include/ucs > /dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "check_installs: the system has UCX's headers; hiding them needs root" >&2; exit 1; }
  exec unshare --mount --propagation private env DATADIST_INSTALLS_HIDDEN=1 "$0" "$@"
fi
if [ -n "${DATADIST_INSTALLS_HIDDEN:-}" ]; then
  for folder in ucp ucs uct ucm; do
    if [ -d "/usr/include/$folder" ]; then mount -t tmpfs -o ro,size=4k tmpfs "/usr/include/$folder"; fi
  done
fi
if [ -e /usr/include/ucp/api/ucp.h ]; then echo "check_installs: UCX's headers are still visible" >&2; exit 1; fi

rm -rf "$work"
mkdir -p "$work"
git clone -q "$source_repo" "$work/src"
wheel_lib() { "$1/bin/python" -c 'import libucx, pathlib; print(pathlib.Path(libucx.__file__).parent / "lib")'; }

demo_over_ucx() {  # venv, where to run from
  for lib_dir in "" "$(wheel_lib "$1")"; do
    (cd "$2" && DATADIST_AIO_UCX_LIB_DIR="$lib_dir" "$1/bin/python" -m datadist_aio demo --layers 2 --blocks 32 \
      --block-kib 16 --transport ucx) > "$work/demo.out" 2>&1 || { cat "$work/demo.out"; exit 1; }
    cat "$work/demo.out"
    if grep -q "UCX  WARN" "$work/demo.out"; then echo "check_installs: UCX warned" >&2; exit 1; fi
  done
}

built_against_wheel() {  # the clone's build folder names the wheel's headers
  # tee appends (-a): opened plainly, /dev/stderr is truncated, and where it
  # is a file (a run's log) all it held before is lost.
  grep -h '^DATADIST_UCX_INCLUDE_DIR:' "$work"/src/build/*/CMakeCache.txt | tee -a /dev/stderr | grep -q '/libucx/include$'
}

fresh_venv() {  # folder, "bundled" or "newest" pip
  python3 -m venv "$1"
  if [ "$2" = newest ]; then "$1/bin/pip" install -q -U pip; fi
  echo "== pip $("$1/bin/pip" --version | cut -d' ' -f2) ($2)"
}

fresh_venv "$work/venv-regular" bundled
echo "== pip install '.[ucx]'"
(cd "$work/src" && "$work/venv-regular/bin/pip" install -q '.[ucx]')
built_against_wheel
demo_over_ucx "$work/venv-regular" "$work"
if (cd "$work/src" && "$work/venv-regular/bin/python" -c 'import datadist_aio' 2> "$work/shadowed.err"); then
  echo "check_installs: importing from the clone's root did not fail" >&2; exit 1
fi
tail -n 1 "$work/shadowed.err"
grep -q "ImportError: datadist_aio's native extension (_native) is not built in $work/src/datadist_aio" \
  "$work/shadowed.err"

fresh_venv "$work/venv-editable" newest
echo "== pip install -e . then pip install -e '.[ucx]'"
rm -rf "$work"/src/build
(cd "$work/src" && "$work/venv-editable/bin/pip" install -q -e . && "$work/venv-editable/bin/pip" install -q -e '.[ucx]')
built_against_wheel
demo_over_ucx "$work/venv-editable" "$work/src"
echo "check_installs: every install moved checked bytes over UCX"
