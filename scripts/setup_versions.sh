#!/usr/bin/env bash
# Extra environments for the newer megatron-core releases that tests/integration/megatron_core/test_megatron_versions.py trains on:
# .venv-mcore-<X>/ for each X in MCORE_VERSIONS (default below). Run after scripts/setup.sh (it needs .venv).
#
# Each is a venv layered on .venv: a .pth file puts .venv's site-packages *after* its own, so it shares .venv's
# torch, numpy, triton, tokenizers, ... and differs from it in megatron-core alone (installed into its own
# site-packages, which Python searches first). That keeps the comparison to one variable and the set-up to a
# few seconds per version (one ~2 MB wheel, nothing compiled).
#
# megatron-core >= 0.17 declares Requires-Python >= 3.12 but PyPI serves cp311 wheels whose code runs on 3.11:
# hence --ignore-requires-python (with --no-deps: its dependencies are .venv's, checked by the import below).
#
# Never fails set-up: a version that does not install or import is recorded in .venv-mcore-<X>.error (the
# command and its output) and its half-built venv removed; the test then skips that version with that text.
# Idempotent: a venv that holds megatron-core at the expected version is kept as it is (a built venv imported it).
set -uo pipefail
cd "$(dirname "$0")/.."
MCORE_VERSIONS=${MCORE_VERSIONS:-"0.17.1 0.18.2 0.19.2"}
BASE_PYTHON=.venv/bin/python
if [ ! -x "$BASE_PYTHON" ]; then
    echo "setup_versions.sh: $BASE_PYTHON not found; run scripts/setup.sh first" >&2
    exit 0
fi
BASE_SITE=$("$BASE_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

check_installed() {  # venv python, version: the venv's own megatron-core at that version, .venv's torch beside it
    "$1" -c "
import importlib.util, sys
from importlib.metadata import version
found, where = version('megatron-core'), importlib.util.find_spec('megatron.core').origin
assert found == '$2' and where.startswith(sys.prefix), \\
    f'expected megatron-core $2 in {sys.prefix}, found {found} at {where}'
assert importlib.util.find_spec('torch') is not None, 'torch not found: is .venv still where the venv was built?'
" 2>&1
}

build_venv() (  # venv dir, version; prints each command before its output, stops at the first failure
    set -e
    echo "\$ $BASE_PYTHON -m venv --without-pip $1"
    "$BASE_PYTHON" -m venv --without-pip "$1"
    site=$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    echo "$BASE_SITE" >"$site/_megatron_mech_base_venv.pth"
    echo "\$ $BASE_PYTHON -m pip --python $1/bin/python install --no-deps --ignore-requires-python megatron-core==$2"
    "$BASE_PYTHON" -m pip -q --disable-pip-version-check --python "$1/bin/python" install --no-deps \
        --ignore-requires-python "megatron-core==$2" 2>&1 | { grep -v "^WARNING: Location" || true; }
    check_installed "$1/bin/python" "$2"
    echo "\$ $1/bin/python -c 'import megatron.core'"
    "$1/bin/python" -W ignore -c "import megatron.core"
)

for version in $MCORE_VERSIONS; do
    venv=".venv-mcore-$version"
    error="$venv.error"
    if [ -x "$venv/bin/python" ] && check_installed "$venv/bin/python" "$version" >/dev/null; then
        rm -f "$error"
        continue
    fi
    rm -rf "$venv" "$error"
    log=$(mktemp)
    build_venv "$venv" "$version" >"$log" 2>&1  # not in an `if`: bash ignores set -e inside a condition
    if [ $? -eq 0 ]; then
        echo "setup_versions.sh: $venv ready (megatron-core $version)"
    else
        tail -n 40 "$log" >"$error"
        rm -rf "$venv"
        echo "setup_versions.sh: megatron-core $version not installed, see $error" >&2
    fi
    rm -f "$log"
done
exit 0
