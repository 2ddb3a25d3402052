"""Run a stock example and its planned twin one after the other in one torchrun launch (one start-up).

    torchrun --standalone --nproc-per-node 2 tests/frameworks/_run_examples.py KIND STOCK.py PLANNED.py PLAN OUT

KIND is lightning or accelerate; each rank saves {"stock": ..., "planned": ...} (batch sizes seen, parameters)
to OUT/rank{RANK}.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from tests._scripts import load_script
from tests.frameworks._common import exit_without_teardown


def main(kind: str, stock_path: str, planned_path: str, plan: str, out: str) -> None:
    stock, planned = load_script(stock_path, "stock_example"), load_script(planned_path, "planned_example")
    stock_args = stock.get_args_parser().parse_args(["--batch-size", "8"])
    planned_args = planned.get_args_parser().parse_args(["--plan", plan])
    if kind == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        results = {"stock": stock.train(stock_args, accelerator), "planned": planned.train(planned_args, accelerator)}
        accelerator.wait_for_everyone()
        accelerator.end_training()
    else:
        results = {"stock": stock.train(stock_args), "planned": planned.train(planned_args)}
    torch.save(results, Path(out) / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:6])
    exit_without_teardown()
