#!/usr/bin/env bash
# Install this project (editable) with the given extras into an existing virtual environment:
#     scripts/install_venv.sh VENV '.[dev,all]'
# With uv where it can be had: it unpacks the wheels in parallel, and torch's CUDA wheels alone are 5 GB
# unpacked (measured on 2 cores: 24 s against pip's 106 s for the same 112 packages). uv reads no pip
# configuration, so scripts/uv_flags.py hands it pip's own (index, extra indexes, find-links, constraints) and
# the packages are the ones pip would take. Where uv cannot be installed or fails, pip does the install.
#
# The Makefile makes the venv --without-pip: ensurepip byte-compiles pip, ~8 s of one core. uv comes from PATH,
# else the venv's own pip, else the base interpreter's pip (`pip --python VENV/bin/python`); uv then installs pip
# into the venv with the rest, so the venv has pip as one made with it would.
set -euo pipefail
venv=$1
shift
py="$venv/bin/python"
here="$(cd "$(dirname "$0")" && pwd)"
base="$("$py" -c 'import sys; print(getattr(sys, "_base_executable", sys.executable))')"
pip_quiet=(install -q --disable-pip-version-check)

uv=""
if command -v uv >/dev/null 2>&1; then
    uv=uv
elif "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip "${pip_quiet[@]}" uv >/dev/null 2>&1 && uv="$venv/bin/uv"
elif "$base" -m pip --version >/dev/null 2>&1; then
    "$base" -m pip --python "$py" "${pip_quiet[@]}" uv >/dev/null 2>&1 && uv="$venv/bin/uv"
fi
if [ -n "$uv" ]; then
    read -r -a flags < <("$base" "$here/uv_flags.py")
    if "$uv" pip install -q --python "$py" "${flags[@]}" pip "$@"; then
        exit 0
    fi
    echo "install_venv: uv failed; installing with pip" >&2
fi
"$py" -m pip --version >/dev/null 2>&1 || "$py" -m ensurepip >/dev/null
exec "$py" -m pip "${pip_quiet[@]}" --no-compile "$@"
