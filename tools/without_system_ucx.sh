#!/usr/bin/env bash
# Runs a command as on a machine without the system's UCX (Debian's
# libucx-dev and libucx0), whatever this one has installed: as root, in a
# mount namespace of this script's own, UCX's header folders under
# /usr/include and its module folder are covered by empty tmpfs mounts, and
# each UCX library where the dynamic loader looks (its cache, `ldconfig -p`,
# and its default folders) by an empty file, so that neither a build nor
# dlopen("libucp.so.0") finds them. The libucx-cu12 wheel's UCX, inside a
# venv, is left as it is. Fails before running the command if libucp.so.0
# still loads or ucp.h is still there.
# Usage: tools/without_system_ucx.sh COMMAND [ARG...]
set -euo pipefail

if [ -z "${DATADIST_SYSTEM_UCX_HIDDEN:-}" ]; then
  [ "$(id -u)" = 0 ] || { echo "without_system_ucx: hiding the system's UCX needs root" >&2; exit 1; }
  exec unshare --mount --propagation private env DATADIST_SYSTEM_UCX_HIDDEN=1 "$0" "$@"
fi

for folder in /usr/include/ucp /usr/include/ucs /usr/include/uct /usr/include/ucm /usr/lib/*-linux-gnu/ucx \
  /usr/lib64/ucx /usr/lib/ucx; do
  if [ -d "$folder" ]; then mount -t tmpfs -o ro,size=4k tmpfs "$folder"; fi
done
names='lib(ucp|ucs|uct|ucm|ucs_signal)\.so[.0-9]*'
{
  ldconfig -p | sed -En "s/^[[:space:]]*$names .* => //p"
  for folder in /lib /usr/lib /lib64 /usr/lib64 /lib/*-linux-gnu /usr/lib/*-linux-gnu /usr/lib/*-linux-gnu/pkgconfig \
    /usr/lib/pkgconfig /usr/share/pkgconfig; do
    find "$folder" -maxdepth 1 -regextype posix-extended \( -regex ".*/$names" -o -name 'ucx*.pc' \) 2> /dev/null || true
  done
} | while read -r path; do realpath -e "$path" 2> /dev/null || true; done | sort -u | while read -r file; do
  mount --bind /dev/null "$file"
done

if python3 -c 'import ctypes; ctypes.CDLL("libucp.so.0")' 2> /dev/null; then
  echo "without_system_ucx: the system's libucp.so.0 still loads" >&2; exit 1
fi
if [ -e /usr/include/ucp/api/ucp.h ]; then echo "without_system_ucx: UCX's headers are still visible" >&2; exit 1; fi
exec "$@"
