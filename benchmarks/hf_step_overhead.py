"""Host time the planned HF Trainer adds per step: the stock Trainer against runtime.adapters.hf.planned_trainer on
a model with next to no compute (one GPT-2 layer, 16 wide), one CPU process, the same batches, alternated.

    python benchmarks/hf_step_overhead.py [--steps 300] [--rounds 2]

Session 6 (this 2-core machine): stock 2.92 ms a step, planned 2.88-2.90 -- the adapter adds no host time, so the
planned run's 8-13 ms per-step miss on 2x H200 (docs/BENCHMARKS.md section 14) is not the adapter's Python.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
from hf_trainer_stock import SyntheticText  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from runtime.adapters.hf import planned_trainer  # noqa: E402
from tests.frameworks._common import write_plan  # noqa: E402


class Stamps(TrainerCallback):  # type: ignore[misc]
    def __init__(self) -> None:
        self.t: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.t.append(time.perf_counter())


def run(kind: str, steps: int, tmp: Path) -> float:
    """Median ms between step ends, after 20 warm-up steps."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=512, n_positions=32))
    stamps = Stamps()
    targs = TrainingArguments(output_dir=str(tmp / "out"), per_device_train_batch_size=8, num_train_epochs=1,
                              use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
                              disable_tqdm=True, dataloader_num_workers=0, max_steps=steps)
    kw: dict[str, Any] = {"model": model, "args": targs, "train_dataset": SyntheticText(8 * steps, 32),
                          "callbacks": [stamps]}
    trainer = planned_trainer(write_plan(tmp / "plan.json", [8]), trainer_cls=Trainer, **kw) if kind == "planned" \
        else Trainer(**kw)
    trainer.train()
    gaps = [b - a for a, b in zip(stamps.t[20:], stamps.t[21:], strict=False)]
    return 1e3 * statistics.median(gaps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            for kind in ("stock", "planned"):
                print(f"round {r + 1}: {kind:8s} {run(kind, args.steps, Path(d)):.3f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
