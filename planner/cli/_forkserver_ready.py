"""Imported by a fork server alone, after every module it preloads (``planner.cli.launch.fork_server`` lists it
last).  Two settings for a process whose only work is to fork ranks:

* ``gc.freeze()``: the preloaded modules' objects (torch, ``torch._dynamo``, the frameworks: a few million) move to
  the collector's permanent generation, so a rank's collections never walk them.  A walk reads and writes each
  object's GC header, which costs CPU and copies, page by page, memory the rank would otherwise share with the
  server.  Measured on 2 CPU cores over 14 tests of 2-rank launches: 66-70 CPU-s before, 57-60 with it.
* When the process that started the server ends, the server leaves without the interpreter's teardown: ~2 s of CPU
  for torch and ``torch._dynamo``, during which it would still hold the launcher's stdout (a pipe reading it waits
  for that).  Its children, the ranks, never run this exit: a fork server's child ends through ``os._exit``
  whatever its exit code.
* The server dies with the process that started it (``prctl(PR_SET_PDEATHSIG)``, planner/lifetime.py), also when
  that process is killed by SIGKILL, where no ``finally`` kills anything; its ranks die with the server
  (planner.cli.launch._rank_entry), and their DataLoader workers with them.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal

from planner.lifetime import die_with_parent

gc.freeze()
atexit.register(os._exit, 0)
die_with_parent(signal.SIGKILL)
