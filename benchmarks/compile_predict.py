"""Does a compiled profile predict compiled steps at batch sizes it never ran?  One JSON line per launch.

Usage (the first on an H200, ~1 minute a launch once inductor's cache is warm; the second anywhere, ~1 minute):

    python benchmarks/compile_predict.py --launches 3 --out compile_predict.jsonl
    python benchmarks/compile_predict.py --device cpu --model tiny_lm --quick --out /tmp/compile_predict.jsonl

Each launch is a fresh process (``--launches N`` starts N of them, one after the other):

1. builds ``--model`` on ``--dataset`` (default tiny_lm:125m on fake_text: GPT-2 small, 1024 tokens a sample),
   bf16 autocast on CUDA, and compiles its step as ``planner profile --compile`` does
   (profiler.compiled.compile_runner: ``torch.compile(model, mode=, backend=)``, every batch tensor's dim 0 marked
   dynamic before its first step);
2. sweeps batch sizes with the profiler's own sweep (profiler.sweep.run_sweep: warm-up, median of repeats, the
   budget and stop rules; default or ``--quick`` options) on that compiled step;
3. on the same compiled step times >= 5 held-out batch sizes the sweep did not run (between its points, and one
   1.25x past its largest), each the median of ``--repeats`` steps after ``--warmup`` steps;
4. writes one JSON line: per held-out size predicted (planner.curves.fit_envelope of the sweep, what a plan
   reads) and measured seconds and the prediction error ``measured / predicted - 1``, the compile record
   (first_s, recompile_s, recompiles, sizes, recompiled_sizes) of the sweep and of the held-out sizes, the torch
   version and the device name.

The parent prints, per held-out size, the median error over the launches with its min-max.  The first launch
compiles with a cold inductor cache (``first_s`` is the whole compile); later ones read the cache (on disk,
``TORCHINDUCTOR_CACHE_DIR`` or torch's default), so their ``first_s`` is what a restarted job pays.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny_lm:125m", help="model spec (default tiny_lm:125m)")
    p.add_argument("--dataset", default="fake_text", help="dataset spec (default fake_text)")
    p.add_argument("--device", default="cuda:0", help="device (default cuda:0)")
    p.add_argument("--amp", choices=("auto", "on", "off"), default="auto", help="bf16 autocast (auto: on for CUDA)")
    p.add_argument("--compile", default="default", metavar="MODE", help="torch.compile mode (default: default)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds of timed sweep steps (default 20; 4 quick)")
    p.add_argument("--quick", action="store_true", help="CPU dry run: the quick sweep, few repeats")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per held-out size (default 10; 3 quick)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per held-out size after its first (2)")
    p.add_argument("--launches", type=int, default=1, help="fresh processes, one after the other (default 1)")
    p.add_argument("--out", required=True, help="JSON lines file: one record per launch is appended")
    return p


def held_out(measured: list[int], n: int = 6) -> list[int]:
    """``n`` sizes the sweep did not run: inside its gaps (each gap's midpoint, widest gap first, then its quarter
    points while more are needed), and one 1.25x past its largest (the extrapolation a plan makes when it gives a
    rank more than was measured)."""
    bs = sorted(set(measured))
    gaps = sorted(itertools.pairwise(bs), key=lambda g: g[0] - g[1])
    picks: list[int] = []
    for frac in (0.5, 0.25, 0.75):
        for a, b in gaps:
            x = round(a + frac * (b - a))
            if len(picks) < n - 1 and a < x < b and x not in picks:
                picks.append(x)
    return [*sorted(picks), int(1.25 * bs[-1]) + 1]


def one_launch(args: argparse.Namespace, launch: int) -> dict[str, Any]:
    import torch

    from planner.curves import fit_envelope
    from profiler import inventory
    from profiler.compiled import CompileOptions, compile_runner
    from profiler.compute import StepRunner
    from profiler.sweep import DoesNotFit, SweepOptions, run_sweep
    from profiler.workloads.specs import build_workload

    device = torch.device(args.device)
    amp = {"auto": device.type == "cuda", "on": True, "off": False}[args.amp]
    workload = build_workload(args.model, args.dataset)
    budget = args.budget_s if args.budget_s is not None else (4.0 if args.quick else 20.0)
    sweep = (SweepOptions.quick(total_budget_s=budget, max_batch=64) if args.quick
             else SweepOptions(total_budget_s=budget))
    repeats = args.repeats or (3 if args.quick else 10)
    t0 = time.perf_counter()
    runner = compile_runner(StepRunner(workload, device, amp=amp),
                            CompileOptions(mode=args.compile, backend=args.backend))
    result = run_sweep(runner.measure, sweep, clock=time.perf_counter)
    sweep_s = time.perf_counter() - t0
    record = runner.meta()["compile"]
    env = fit_envelope(result.compute_points())
    measured = [p.batch_size for p in result.points]
    rows: list[dict[str, Any]] = []
    for b in held_out(measured):
        try:
            m = runner.measure(b, args.warmup, repeats)
        except DoesNotFit:
            rows.append({"batch_size": b, "does_not_fit": True})
            continue
        meas, pred = float(statistics.median(m.times_s)), float(env(b))
        rows.append({"batch_size": b, "predicted_s": pred, "measured_s": meas, "error": meas / pred - 1.0,
                     "measured_min_s": min(m.times_s), "measured_max_s": max(m.times_s), "repeats": len(m.times_s),
                     "extrapolated": b > max(measured)})
    after = runner.meta()["compile"]
    name, _ = inventory.device_facts(device)
    runner.close()
    return {
        "kind": "compile_predict", "launch": launch, "model": args.model, "dataset": args.dataset,
        "sample_shape": list(workload.sample_shape), "device": str(device), "device_name": name,
        "torch": torch.__version__, "cuda": torch.version.cuda, "amp": "bf16" if amp else None,
        "compile_mode": args.compile, "backend": args.backend,
        "sweep": [{"batch_size": p.batch_size, "step_time_s": p.median_s, "repeats": len(p.times_s)}
                  for p in result.points],
        "sweep_stop": result.stop_reason, "sweep_wall_s": round(sweep_s, 3),
        "first_s": record["first_s"], "recompiles": record["recompiles"], "compile": record,
        "held_out_recompiles": after["recompiles"] - record["recompiles"],
        "held_out_recompiled_sizes": [b for b in after["recompiled_sizes"] if b not in record["recompiled_sizes"]],
        "held_out": rows,
        "max_abs_error": max((abs(r["error"]) for r in rows if "error" in r), default=None),
    }


def summarize(records: list[dict[str, Any]]) -> list[str]:
    """Per held-out size over the launches: median error [min-max]; first_s and recompiles per launch."""
    lines = [f"{r['device_name']}, torch {r['torch']}, {r['model']}: launch {r['launch']}: first_s {r['first_s']} s, "
             f"recompiles {r['recompiles']} in the sweep, {r['held_out_recompiles']} at held-out sizes, sweep "
             f"{[p['batch_size'] for p in r['sweep']]}" for r in records]
    by_size: dict[int, list[float]] = {}
    for r in records:
        for h in r["held_out"]:
            if "error" in h:
                by_size.setdefault(h["batch_size"], []).append(h["error"])
    for b, errs in sorted(by_size.items()):
        lines.append(f"  batch {b}: error {100 * statistics.median(errs):+.1f}% "
                     f"[{100 * min(errs):+.1f}% .. {100 * max(errs):+.1f}%] over {len(errs)} launch(es)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = get_args_parser()
    p.add_argument("--launch-index", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.launch_index is not None or args.launches == 1:
        rec = one_launch(args, args.launch_index or 0)
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if args.launch_index is None:
            print("\n".join(summarize([rec])))
        return 0
    start = out.read_text().count("\n") if out.exists() else 0
    child = [a for a in (argv if argv is not None else sys.argv[1:])]
    for i in range(args.launches):
        cmd = [sys.executable, os.path.abspath(__file__), *child, "--launch-index", str(i)]
        subprocess.run(cmd, check=True, timeout=900)
    records = [json.loads(line) for line in out.read_text().splitlines()[start:] if line.strip()]
    print("\n".join(summarize(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
