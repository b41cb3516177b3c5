#!/bin/sh
# Install hisparse-sglang from this checkout on a fresh Debian/Ubuntu machine, then run the demo.
#
#   scripts/install.sh                 # system libraries, .venv, pip install '.[test,mooncake]', hisparse-demo
#   scripts/install.sh --system-only   # only the system libraries (apt-get)
#   SGLANG=0.5.17 scripts/install.sh   # pin SGLang (default: the newest supported release pip picks)
#
# Environment: PYTHON (default python3, >= 3.11), VENV (default .venv), EXTRAS (default test,mooncake),
# SGLANG (a release to pin).
#
# The system libraries need root: as root the script runs apt-get itself (a fresh Debian has no sudo), as
# another user through sudo. They are what the Mooncake transfer engine loads (libibverbs1, libnuma1,
# libcurl4) and python3-venv (Debian and Ubuntu ship `python3 -m venv` without ensurepip otherwise).
set -eu

APT_PACKAGES="libibverbs1 libnuma1 libcurl4 python3-venv"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test,mooncake}

case "${1:-}" in
  "") system_only=0 ;;
  --system-only) system_only=1 ;;
  *) echo "usage: scripts/install.sh [--system-only]" >&2; exit 2 ;;
esac

if [ "$(id -u)" -eq 0 ]; then
  as_root=""
elif command -v sudo >/dev/null 2>&1; then
  as_root="sudo"
else
  echo "install.sh: installing $APT_PACKAGES needs root: run this script as root, or install sudo" >&2
  exit 1
fi

$as_root apt-get update
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $APT_PACKAGES
[ "$system_only" -eq 1 ] && exit 0

cd "$(dirname "$0")/.."
"$PYTHON" -m venv "$VENV"
if [ -n "${SGLANG:-}" ]; then
  "$VENV/bin/pip" install ".[$EXTRAS]" "sglang==$SGLANG"
else
  "$VENV/bin/pip" install ".[$EXTRAS]"
fi
"$VENV/bin/hisparse-demo"
