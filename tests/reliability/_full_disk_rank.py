"""`planner train` as one rank of a launch (tests/_ranks.py), rank 0's checkpoint save meeting a full disk: every
``os.write`` to a checkpoint temp file fails with ENOSPC on rank 0 only, as a full local disk would."""

from __future__ import annotations

import errno
import os
import sys

from planner.cli import main_and_exit

if os.environ.get("RANK") == "0":
    real = os.write

    def write(fd: int, data: bytes) -> int:  # type: ignore[override]
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if "/.checkpoint." in target:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    os.write = write  # type: ignore[assignment]

main_and_exit(sys.argv[1:])
