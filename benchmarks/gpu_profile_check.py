"""Does the profile predict step times it never measured?  Profile, then time held-out batch sizes.

Usage (the lead runs the first on an H100; the second runs anywhere):

    python benchmarks/gpu_profile_check.py --model resnet50 --device cuda:0 --out gpu_check.json
    python benchmarks/gpu_profile_check.py --model mlp --device cpu --budget-s 5 --out /tmp/cpu_check.json

1. Profiles the model with the product's own path (profiler.run.profile_this_rank, loader skipped) on a budget
   (default 30 s of profiling; bf16 autocast and channels_last on CUDA).
2. Separately (a fresh model and optimizer) times full training steps at two batch sizes NOT in the sweep --
   1.25x a measured batch at about 1/3 and 2/3 of the measured range, or --holdout B1,B2 -- 20 repeats, median.
3. Prints predicted (planner.curves.fit_envelope of the profile) vs measured and the error %, and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.curves import fit_envelope
from planner.table import table
from profiler.compute import StepRunner
from profiler.run import gather_profile, profile_this_rank
from profiler.sweep import SweepOptions
from profiler.workloads.specs import build_workload


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50", help="model spec (default resnet50)")
    p.add_argument("--image-size", type=int, default=None, help="input side in pixels (default per model)")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--amp", choices=("auto", "on", "off"), default="auto", help="bf16 autocast (auto: on for CUDA)")
    p.add_argument("--channels-last", choices=("auto", "on", "off"), default="auto", help="auto: on for CUDA")
    p.add_argument("--budget-s", type=float, default=30.0, help="seconds of profiling allowed (default 30)")
    p.add_argument("--holdout", default=None, metavar="B1,B2", help="held-out batch sizes (default: chosen)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per held-out batch (median)")
    p.add_argument("--out", default="gpu_profile_check.json", help="result JSON")
    p.add_argument("--profile-out", default=None, help="also write the profile JSON here")
    return p


def holdout_batches(measured: list[int]) -> list[int]:
    """1.25x a measured batch at ~1/3 and ~2/3 of the range: between sweep points, never one of them."""
    bs = sorted(measured)
    picks = sorted({bs[max(0, (len(bs) - 2) // 3)], bs[max(0, 2 * (len(bs) - 2) // 3)]})
    out = [int(1.25 * b) for b in picks]
    return [b for b in out if b not in bs] or [bs[0] + 1]


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    amp = {"auto": cuda, "on": True, "off": False}[args.amp]
    channels_last = {"auto": None, "on": True, "off": False}[args.channels_last]
    workload = build_workload(args.model, "fake", image_size=args.image_size)

    # 1. profile on a budget.  The sweep gets 75% of it: the rest covers warm-up of the first shapes and the
    # memory search, so the whole call stays inside --budget-s.
    sweep = SweepOptions(total_budget_s=0.75 * args.budget_s, point_budget_s=min(1.0, args.budget_s / 30))
    t0 = time.perf_counter()
    rp = profile_this_rank(workload, device, quick=False, amp=amp, channels_last=channels_last, measure_loader=False,
                           sweep=sweep)
    profile_s = time.perf_counter() - t0
    if args.profile_out:
        single = gather_profile(rp, workload=workload, meta={"command": "benchmarks/gpu_profile_check.py"})
        assert single is not None  # no process group: this process is the whole job
        single.save(args.profile_out)
    env = fit_envelope(rp.compute)
    measured = [p.batch_size for p in rp.compute]
    cap = rp.memory.max_batch_size if rp.memory else None

    # 2. held-out batches, timed separately.
    held = [int(x) for x in args.holdout.split(",")] if args.holdout else holdout_batches(measured)
    if cap is not None:
        held = [b for b in held if b <= cap]
    runner = StepRunner(workload, device, amp=amp, channels_last=channels_last)
    rows: list[tuple[object, ...]] = []
    results: list[dict[str, Any]] = []
    for b in held:
        m = runner.measure(b, 3, args.repeats)
        meas = statistics.median(m.times_s)
        pred = env(b)
        err = 100.0 * (meas / pred - 1.0)  # measured / predicted - 1, the sign convention of every benchmark
        results.append({"batch_size": b, "predicted_s": pred, "measured_s": meas, "error_pct": err,
                        "peak_bytes": m.peak_bytes})
        rows.append((b, f"{1000 * pred:.2f}", f"{1000 * meas:.2f}", f"{err:+.1f}%"))
    runner.close()

    # 3. report.
    print(f"{rp.device_name} ({rp.device}), {args.model}, amp={'bf16' if amp else 'off'}, "
          f"channels_last={rp.meta.get('channels_last')}")
    print(f"profiled {len(measured)} batch sizes {measured} in {profile_s:.1f} s (budget {args.budget_s:g} s); "
          f"sweep stopped: {rp.meta.get('sweep_stop')}; max batch {cap}")
    print(table(["held-out batch", "predicted ms", "measured ms", "error"], rows))
    doc: dict[str, Any] = {
        "kind": "gpu_profile_check",
        "device": rp.device,
        "device_name": rp.device_name,
        "model": args.model,
        "sample_shape": list(workload.sample_shape),
        "amp": "bf16" if amp else None,
        "channels_last": rp.meta.get("channels_last"),
        "profile_s": profile_s,
        "budget_s": args.budget_s,
        "within_budget": profile_s <= args.budget_s,
        "compute": [{"batch_size": p.batch_size, "step_time_s": p.step_time_s} for p in rp.compute],
        "max_batch_size": cap,
        "sweep_stop": rp.meta.get("sweep_stop"),
        "holdout": results,
        "max_abs_error_pct": max((abs(r["error_pct"]) for r in results), default=None),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
