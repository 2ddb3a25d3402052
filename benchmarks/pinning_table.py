"""One markdown row per loader_gpu.sh launch: how its batches were pinned and what rank 0 paid for it, with the
host's state beside (docs/BENCHMARKS.md section 21).

    python benchmarks/pinning_table.py docs/results/h100x2_train_auto_replan_s13a_ [PREFIX ..] \
        [--hostmon docs/results/h100x2_hostmon_s13a.jsonl ..]

Per launch (``<prefix><case>_r<i>_*``): the plan, the wall ratio (measured / predicted samples/s) of each clean
epoch (no fill or drain step: ``loader_summary.py``'s ``clean_wall_ratio`` reads the same ones), the worst rank's
error there, rank 0's mean data wait and its compute's median, mean and 90th percentile over those epochs
(``--step-log``; a mean over the median is a tail of long steps, session 15), each rank's loader period over its
plan's loader time and the host's busy share at those epochs' ends (the run log), the pinned-host pool at the end
(blocks, GB), and from the host monitor, when given, the cores lost to steal and the median of its fixed 128 MiB
memory-copy probe (ms; the host's memory got slower as steal rose) over the launch.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loader_summary import _plans, launch_summary
from step_log_segments import read_step_logs

from planner.runlog import read_run_log


def _steps(prefix: str, rank: int) -> list[dict[str, Any]]:
    return read_step_logs(prefix).get(rank, [])


def _started(prefix: str) -> float:
    return min((e["start_unix"] for e in _steps(prefix, 0)), default=0.0)


def _host(rows: list[dict[str, Any]], t0: float, t1: float) -> tuple[float, float] | None:
    inside = [r for r in rows if t0 <= r.get("t", 0) <= t1 and "cpu" in r]
    if not inside:
        return None
    steal = statistics.fmean(r["cpu"][7] / 100 / r["dt"] for r in inside)
    mem = statistics.median(r["probe"]["mem"][0] for r in inside if "probe" in r)
    return steal, mem


def _loaders(log: Any, epochs: set[int]) -> str:
    """Each rank's median measured loader period over its plan's loader time in ``epochs``, and the host's median
    busy share at their ends (rank 0's reading)."""
    plans = _plans(log)
    ratios: dict[int, list[float]] = {}
    busy = []
    for e in (e for e in log.epochs if e.epoch in epochs):
        plan = plans.get(e.plan_fingerprint)
        for i, st in enumerate(e.ranks):
            planned = plan.ranks[i].predicted_loader_s if plan is not None else None
            if planned and st.loader_period_s:
                ratios.setdefault(i, []).append(st.loader_period_s / planned)
        if e.device_state and e.device_state[0] is not None and e.device_state[0].cpu_busy_frac is not None:
            busy.append(e.device_state[0].cpu_busy_frac)
    cells = ", ".join(f"{statistics.median(v):.2f}" for _i, v in sorted(ratios.items())) or "-"
    return f"{cells} / {statistics.median(busy):.0%}" if busy else f"{cells} / -"


def row(prefix: str, hostmon: list[dict[str, Any]]) -> str:
    log = read_run_log(prefix + "_run.jsonl")
    s = launch_summary(log, None)
    clean = [e for e in s["epochs"]
             if e["epoch"] >= 1 and not e["fill_steps"] and not e["drain_steps"] and not e["refill"]]
    steps = {e["epoch"]: e for e in _steps(prefix, 0)}
    waits = [statistics.fmean(steps[e["epoch"]]["data_wait_ms"]) for e in clean if e["epoch"] in steps]
    comp = [c for e in clean if e["epoch"] in steps for c in steps[e["epoch"]]["compute_ms"]]
    last = steps[max(steps)] if steps else {}
    pool = last.get("pinned") or {}
    host = None
    if steps:  # from the first epoch's start to the last one's end (an epoch's length after it)
        starts = sorted(e["start_unix"] for e in steps.values())
        host = _host(hostmon, starts[0], starts[-1] + (starts[-1] - starts[-2] if len(starts) > 1 else 20))
    name = Path(prefix).name
    return "| " + " | ".join([
        name, str(s["epochs"][0]["batch_sizes"]),
        ", ".join(f"{e['wall_ratio']:.3f}" for e in clean) or "-",
        ", ".join(f"{max(e['rank_errors'], key=abs):+.1%}" for e in clean) or "-",
        f"{statistics.fmean(waits):.1f}" if waits else "-",
        (f"{statistics.median(comp):.1f} / {statistics.fmean(comp):.1f} / "
         f"{statistics.quantiles(comp, n=10)[-1]:.1f}") if len(comp) > 1 else "-",
        _loaders(log, {e["epoch"] for e in clean}),
        f"{pool.get('allocs', 0):.0f} / {pool.get('pool_mb', 0) / 1000:.1f}" if pool else "-",
        f"{host[0]:.2f} / {host[1]:.0f}" if host else "-"]) + " |"


HEADER = ("| launch | plan | wall / predicted, clean epochs | worst rank error | rank 0 wait, ms | rank 0 compute "
          "median / mean / p90, ms | loaders / plan by rank, host busy | pinned blocks / GB | steal cores / mem probe "
          "ms |\n|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefixes", nargs="+", help="a results prefix, e.g. docs/results/h100x2_train_auto_replan_s13a_")
    p.add_argument("--hostmon", nargs="*", default=[], help="hostmon.jsonl files of the same calls")
    args = p.parse_args(argv)
    hostmon = [json.loads(line) for f in args.hostmon for line in Path(f).read_text().splitlines() if line.strip()]
    print(HEADER)
    for prefix in args.prefixes:
        launches = [run[: -len("_run.jsonl")] for run in glob.glob(prefix + "*_r[0-9]*_run.jsonl")]
        for launch in sorted(launches, key=_started):  # in the order they ran
            print(row(launch, hostmon))
    return 0


if __name__ == "__main__":
    sys.exit(main())
