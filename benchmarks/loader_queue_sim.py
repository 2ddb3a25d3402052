"""Replay a rank's `--step-log` through a model of the DataLoader's delivery: is its data wait the workers'?

    python benchmarks/loader_queue_sim.py docs/results/h100x2_train_auto_replan_s13b_loaderDP_r1_steps0.jsonl \
        [--workers 28] [--prefetch 4] [--pin-ms 0,88,105]

The model (``simulate``): W workers take batch i in turn (i mod W), each building its batches one after another
with the step log's own build times (``loader_ms``, what each batch cost its worker); prefetch x W tasks are out at
the start and one more is sent as the loop takes each batch; one pin thread copies each finished batch, in the
order they finish, in ``pin_ms``; the loop takes batch i once it is pinned and then steps for its logged compute
time.  Its output is the wait per step that those alone cause, beside the wait the rank measured.

With ``gc`` in the step log (``planner.cli.steps.GcPauses``) it also says how much of the long data waits fell in steps
where a garbage collection began (``waits_in_gc``).

Session 13 (2x H100, the loader case, the DataLoader's pinning): the model gives no wait in any epoch, even with a
105 ms pin and in the launch whose host lost 0.36 cores to steal (measured 41-43 ms), so the measured waits (4-8 ms
in quiet launches) are not the workers' rate nor a serial pin: they come from the training process's side of the
hand-over (docs/BENCHMARKS.md section 21).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
from pathlib import Path


def simulate(build_ms: list[float], compute_ms: list[float], workers: int, prefetch: int,
             pin_ms: float = 0.0) -> list[float]:
    """The loop's wait (ms) before each step, from the workers' build times and the loop's compute times alone."""
    n = len(build_ms)
    free = [0.0] * workers
    built: list[tuple[float, int]] = []  # (finish time, batch)
    pinned: dict[int, float] = {}
    pin_free = t = 0.0
    waits = []

    def send(i: int, at: float) -> None:
        k = i % workers
        free[k] = max(free[k], at) + build_ms[i] / 1000
        heapq.heappush(built, (free[k], i))

    for i in range(min(n, prefetch * workers)):
        send(i, 0.0)
    for i in range(n):
        while i not in pinned:  # the pin thread takes batches as they finish, whatever their order
            done, j = heapq.heappop(built)
            pin_free = max(pin_free, done) + pin_ms / 1000
            pinned[j] = pin_free
        waits.append(1000 * max(0.0, pinned[i] - t))
        t = max(t, pinned[i]) + compute_ms[i] / 1000
        if i + prefetch * workers < n:
            send(i + prefetch * workers, t)
    return waits


def replay(path: Path, workers: int, prefetch: int, pin_ms: float, skip: int = 5) -> list[dict[str, float]]:
    """Per epoch of a step log: the model's mean wait and the measured one (each epoch's first ``skip`` steps out)."""
    epochs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    build = [b for e in epochs for b in e["loader_ms"]]
    compute = [c for e in epochs for c in e["compute_ms"]]
    waits = simulate(build, compute, workers, prefetch, pin_ms)
    out, at = [], 0
    for e in epochs:
        n = len(e["loader_ms"])
        out.append({"epoch": e["epoch"], "model_wait_ms": round(statistics.fmean(waits[at + skip:at + n]), 2),
                    "measured_wait_ms": round(statistics.fmean(e["data_wait_ms"][skip:]), 2)})
        at += n
    return out


def waits_in_gc(path: Path, min_wait_ms: float = 20.0) -> list[dict[str, float]]:
    """Per epoch of a step log with ``gc`` pauses (planner.cli.steps.GcPauses, session 13 on): the data wait of steps of at
    least ``min_wait_ms`` in all, and the part of it in steps during which a garbage collection of 5 ms or more
    began (a step's span: the sum of the step times before it, from the loop's start)."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        e = json.loads(line)
        pauses = (e.get("gc") or {}).get("pauses", [])
        t, total, in_gc = 0.0, 0.0, 0.0
        for wait, step in zip(e["data_wait_ms"], e["step_time_ms"], strict=False):
            end = t + (step or 0.0)
            if wait is not None and wait >= min_wait_ms:
                total += wait
                if any(t <= p[0] < end for p in pauses):
                    in_gc += wait
            t = end
        out.append({"epoch": e["epoch"], "long_waits_ms": round(total, 1), "in_gc_ms": round(in_gc, 1),
                    "gc_pauses": len(pauses), "gc_ms": round(sum(p[1] for p in pauses), 1)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step_logs", nargs="+", type=Path)
    p.add_argument("--workers", type=int, default=28)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--pin-ms", default="0,88,105", help="pin thread's ms a batch, a list")
    args = p.parse_args(argv)
    for path in args.step_logs:
        if any("gc" in json.loads(x) for x in path.read_text().splitlines() if x.strip()):
            for r in waits_in_gc(path):
                print(f"{path.name} epoch {r['epoch']:.0f}: waits of 20 ms or more {r['long_waits_ms']:.0f} ms, "
                      f"{r['in_gc_ms']:.0f} ms of them in steps where a collection began "
                      f"({r['gc_pauses']:.0f} pauses, {r['gc_ms']:.0f} ms)")
        for pin in (float(v) for v in args.pin_ms.split(",")):
            rows = replay(path, args.workers, args.prefetch, pin)
            print(f"{path.name} pin {pin:g} ms: " + " | ".join(
                f"epoch {r['epoch']:.0f} model {r['model_wait_ms']:.1f} measured {r['measured_wait_ms']:.1f}"
                for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
