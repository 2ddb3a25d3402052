"""Print pip's configuration (files and PIP_* variables, as `pip config list` reads them) as uv's options.

uv reads no pip configuration, and an install with uv must take the same packages from the same places as pip:
index-url, extra-index-url, find-links and constraint become uv's options of the same names; a configured cert
bundle becomes --native-tls (uv then trusts the system's certificate store rather than its own).
``--index-strategy unsafe-best-match`` is pip's rule across indexes (the best version from any of them) rather
than uv's default (the first index that has the package).
"""

from __future__ import annotations

import shlex
import subprocess
import sys

LISTS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}


def pip_config() -> dict[str, str]:
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:  # "global.find-links='/opt/wheels'" (a file) or ":env:.find-links='/opt/wheels'" (PIP_FIND_LINKS)
            (env if key.startswith(":env:") else files)[key.rpartition(".")[2]] = " ".join(shlex.split(value))
    return {**files, **env}  # as in pip, a PIP_* variable overrides the files


def main() -> None:
    config = pip_config()
    flags = ["--index-strategy", "unsafe-best-match"]
    for key, flag in LISTS.items():
        for value in config.get(key, "").split():
            flags += [flag, value]
    if config.get("cert"):
        flags.append("--native-tls")
    print(" ".join(flags))


if __name__ == "__main__":
    main()
