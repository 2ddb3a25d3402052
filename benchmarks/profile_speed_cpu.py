"""CPU check of issue 16 item 6: the fast sweep's fitted step-time curve against the thorough (pre-#16) one.

    python3 benchmarks/profile_speed_cpu.py [--model cifar_cnn] [--rounds 2]     # JSON to $OUT if set

Interleaved rounds of both sweep policies on one CPU thread, timed with the thread's CPU clock (a shared box's
preemption does not count), then the fitted curves (what the planner uses) at a few batches, fast / thorough - 1
of the medians over rounds.  Seen on the 2-core CI box, cifar_cnn, 2 rounds: within 1.6% at 8..512 but one noisy
point (+8.7% at 128 in one round); linear to 128 and 2x steeper by 512, so the check point past the linear tail
found the bend and the fast sweep went on to 512 like the thorough one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from planner.curves import fit_envelope
from profiler.compute import StepRunner
from profiler.sweep import SweepOptions, run_sweep
from profiler.workloads.specs import build_workload

BATCHES = (8, 32, 64, 128, 256, 512)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cifar_cnn")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--budget-s", type=float, default=40.0, help="sweep budget in CPU seconds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    workload = build_workload(args.model, "fake")
    policies = {"fast": SweepOptions(max_batch=args.max_batch, total_budget_s=args.budget_s),
                "thorough": SweepOptions.thorough(max_batch=args.max_batch, total_budget_s=args.budget_s)}
    runs: dict[str, list[dict[str, object]]] = {k: [] for k in policies}
    for _ in range(args.rounds):
        for name, opts in policies.items():  # interleaved: a drift of the machine hits both alike
            runner = StepRunner(workload, "cpu", timer=time.thread_time)
            t0 = time.perf_counter()
            res = run_sweep(runner.measure, opts, clock=time.thread_time)
            fit = fit_envelope(res.compute_points())
            runs[name].append({"wall_s": round(time.perf_counter() - t0, 2), "stop": res.stop_reason,
                               "batches": [q.batch_size for q in res.points],
                               "fit_s": {str(b): fit(b) for b in BATCHES}})
            runner.close()
            print(name, runs[name][-1]["wall_s"], "s", runs[name][-1]["stop"], runs[name][-1]["batches"], flush=True)
    diff = {}
    for b in BATCHES:
        fast = statistics.median(float(r["fit_s"][str(b)]) for r in runs["fast"])  # type: ignore[index]
        slow = statistics.median(float(r["fit_s"][str(b)]) for r in runs["thorough"])  # type: ignore[index]
        diff[str(b)] = round(fast / slow - 1, 4)
        print(f"batch {b}: fast {1000 * fast:.2f} ms, thorough {1000 * slow:.2f} ms, {100 * diff[str(b)]:+.1f}%")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "profile_speed_cpu.json").write_text(json.dumps({"runs": runs, "rel_diff": diff}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
