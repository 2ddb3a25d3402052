#!/usr/bin/env bash
# Make sure a headless Chromium is on PATH (Debian's package); used by CI before the report rendering test.
# Prints the binary's path.  Needs root (or sudo) only when Chromium is missing.
set -euo pipefail

find_chromium() {
    for name in chromium chromium-browser google-chrome chrome; do
        if command -v "$name" >/dev/null 2>&1; then
            command -v "$name"
            return 0
        fi
    done
    return 1
}

if find_chromium; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "chromium is missing and this user cannot install packages (not root, no sudo)" >&2
        exit 1
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
find_chromium
