"""Replay a rank's `--step-log` through a model of the DataLoader's delivery: is its data wait the workers'?

    python benchmarks/loader_queue_sim.py docs/results/h100x2_train_auto_replan_s13b_loaderDP_r1_steps0.jsonl \
        [--workers 28] [--prefetch 4] [--pin-ms 0,88,105]

The model (``simulate``): W workers take batch i in turn (i mod W), each building its batches one after another
with the step log's own build times (``loader_ms``, what each batch cost its worker); prefetch x W tasks are out at
the start and one more is sent as the loop takes each batch; one pin thread copies each finished batch, in the
order they finish, in ``pin_ms``; the loop takes batch i once it is pinned and then steps for its logged compute
time.  Its output is the wait per step that those alone cause, beside the wait the rank measured.

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step_logs", nargs="+", type=Path)
    p.add_argument("--workers", type=int, default=28)
    p.add_argument("--prefetch", type=int, default=4)
    p.add_argument("--pin-ms", default="0,88,105", help="pin thread's ms a batch, a list")
    args = p.parse_args(argv)
    for path in args.step_logs:
        for pin in (float(v) for v in args.pin_ms.split(",")):
            rows = replay(path, args.workers, args.prefetch, pin)
            print(f"{path.name} pin {pin:g} ms: " + " | ".join(
                f"epoch {r['epoch']:.0f} model {r['model_wait_ms']:.1f} measured {r['measured_wait_ms']:.1f}"
                for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
