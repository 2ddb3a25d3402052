"""Import what the tests' processes import, once, so that Python leaves the bytecode of every module in the venv.

    python scripts/warm_imports.py core|frameworks

The install compiles nothing (scripts/install_venv.sh), so the first import of each module compiles it: about 12 s
of CPU for torch, torchvision and the rest of `planner train`'s imports, about 17 s for transformers, Lightning,
Accelerate and Ray (2 cores, CPython 3.11).  Processes that start together -- the two pytest workers and their fork
servers, Ray's daemons and workers -- would each compile the same modules.  `make test` runs this while mypy runs,
one process per group, so the compiling happens once, on the core mypy leaves idle.  A module that is not
installed is skipped: this only warms a cache.
"""

from __future__ import annotations

import importlib
import sys

GROUPS = {
    "core": ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torchvision", "numpy",
             "scipy.optimize", "psutil", "matplotlib.pyplot", "pytest", "xdist", "planner", "planner.cli",
             "planner.cli.train", "planner.cli.autoplan", "planner.cli.bench", "profiler", "profiler.run", "runtime",
             "reports", "hypothesis", "jsonschema"],
    "frameworks": ["transformers", "transformers.trainer", "lightning", "lightning.pytorch", "accelerate", "ray",
                   "ray.train", "ray.train.torch", "pytorch_lightning", "aiohttp"],
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in GROUPS:
        print(f"usage: python scripts/warm_imports.py {'|'.join(GROUPS)}", file=sys.stderr)
        return 2
    for name in GROUPS[argv[0]]:
        try:
            importlib.import_module(name)
        except Exception:  # not installed, or fails to import: the tests will say so
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
