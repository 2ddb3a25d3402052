"""Run examples/hf_trainer_planned.py's and examples/hf_trainer_stock.py's ``main`` one after the other in one
launch (one start-up and one import of transformers' Trainer per rank instead of two):

    tests/_ranks.py: _run_hf_examples.py PLAN OUT [example args ...]

The planned example runs first (in a fresh process, as a user's launch would) on PLAN, the stock one then on
``--batch-size 8``, both with the given example args and ``--out OUT/<which>``. Before each, a line
``example: <which>`` marks where its output starts. Each example's ``main`` destroys the process group the
Trainer started; the planned one's is kept for the stock run (the Trainer's distributed state is per process)
and the stock one's ends it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from tests._scripts import load_script
from tests.frameworks._common import REPO


def main(plan: str, out: str, *args: str) -> None:
    runs = (("planned", ["--plan", plan]), ("stock", ["--batch-size", "8"]))
    destroy = torch.distributed.destroy_process_group
    for i, (which, own) in enumerate(runs):
        example = load_script(REPO / "examples" / f"hf_trainer_{which}.py", f"hf_trainer_{which}_example")
        print(f"example: {which}", flush=True)
        last = i == len(runs) - 1
        torch.distributed.destroy_process_group = destroy if last else (lambda *a, **k: None)  # type: ignore[assignment]
        try:
            assert example.main([*own, *args, "--out", str(Path(out) / which)]) == 0
        finally:
            torch.distributed.destroy_process_group = destroy
        sys.stdout.flush()


if __name__ == "__main__":
    main(*sys.argv[1:])
