"""The launch environment a plan may carry: a closed list of NCCL variables, each with its value rule.

A profile records a launch setting only when the profiler timed it to beat NCCL's defaults
(``planner.comm_model.choose_launch_env``); the plan copies it, ``planner train`` puts it in the environment
before the process group starts, and ``planner plan --print-env`` prints it for ``eval`` in a launch script.
Profiles and plans are data, and data never chooses code or the environment code runs in: a file naming any
other variable (``LD_PRELOAD``, ``PYTHONPATH``, ...) or a value outside its rule is refused at load, in
``planner validate``, in the ``Plan`` itself, when printed and when applied.  The printed lines quote every value
(``shlex.quote``) all the same.

A new setting the profiler learns to measure joins ``LAUNCH_ENV_VARS`` with its value rule.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from planner.errors import ValidationError

_CTAS = re.compile(r"[1-9][0-9]?")
LAUNCH_ENV_VARS: dict[str, tuple[re.Pattern[str], str]] = {
    "NCCL_MIN_CTAS": (_CTAS, "an integer 1-99"),
    "NCCL_MAX_CTAS": (_CTAS, "an integer 1-99"),
}
"""Variable -> (the full-match rule for its value, the rule in words): what the profiler measures, nothing else."""


def check_launch_env(env: Mapping[Any, Any], path: str = "launch_env") -> dict[str, str]:
    """``env`` as a plain dict of allowed variables and values; ValidationError naming the first one refused."""
    out: dict[str, str] = {}
    for name, value in env.items():
        shown = ascii(name)[:60]
        if not isinstance(name, str) or name not in LAUNCH_ENV_VARS:
            raise ValidationError(f"{path}: {shown} is not a launch setting the profiler measures (allowed: "
                                  f"{', '.join(LAUNCH_ENV_VARS)}); a profile or plan never sets other variables")
        rule, words = LAUNCH_ENV_VARS[name]
        if not isinstance(value, str) or not rule.fullmatch(value):
            raise ValidationError(f"{path}.{name}: {ascii(value)[:60]} is not {words}")
        out[name] = value
    return out


def export_lines(env: Mapping[str, str]) -> list[str]:
    """``export NAME=VALUE`` lines for a shell script: checked, values quoted, names sorted (stable output)."""
    checked = check_launch_env(env)
    return [f"export {k}={shlex.quote(v)}" for k, v in sorted(checked.items())]


__all__ = ["LAUNCH_ENV_VARS", "check_launch_env", "export_lines"]
