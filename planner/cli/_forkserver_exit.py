"""Imported by a fork server alone (the last module ``planner.cli.launch.fork_server`` has it preload): when the
process that started the server ends, the server leaves without the interpreter's teardown -- ~2 s of CPU for torch
and ``torch._dynamo``, during which it would still hold the launcher's stdout (a pipe reading it waits for that).  Its
children, the ranks, never run this: a fork server's child ends through ``os._exit`` whatever its exit code."""

from __future__ import annotations

import atexit
import os

atexit.register(os._exit, 0)
