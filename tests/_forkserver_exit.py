"""Imported by the tests' fork server alone (tests/_dist.py's preload list): when the pytest process that started it
ends, the server leaves without the interpreter's teardown, ~2 s of CPU for the modules it preloaded.  Its
children, the ranks, never run it: a fork server's child ends through ``os._exit`` whatever its code."""

from __future__ import annotations

import atexit
import os

atexit.register(os._exit, 0)
