#!/usr/bin/env bash
# Install this project (editable) with the given extras into an existing virtual environment:
#     scripts/install_venv.sh VENV '.[dev,all]'
# With uv where it can be had: it unpacks the wheels in parallel, and torch's CUDA wheels alone are 5 GB
# unpacked (measured on 2 cores: 24 s against pip's 106 s for the same 112 packages). uv reads no pip
# configuration, so scripts/uv_flags.py hands it pip's own (index, extra indexes, find-links, constraints) and
# the packages are the ones pip would take. Where uv cannot be installed or fails, pip does the install.
set -euo pipefail
venv=$1
shift
py="$venv/bin/python"
here="$(cd "$(dirname "$0")" && pwd)"
if "$py" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1; then
    read -r -a flags < <("$py" "$here/uv_flags.py")
    if "$venv/bin/uv" pip install -q --python "$py" "${flags[@]}" "$@"; then
        exit 0
    fi
    echo "install_venv: uv failed; installing with pip" >&2
fi
exec "$py" -m pip install -q --disable-pip-version-check --no-compile "$@"
