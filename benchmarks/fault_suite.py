"""Does the live diagnosis name the cause of a slow rank?  Inject one fault on one rank at a seeded random epoch of
an own-loop run (benchmarks/_fault_own_loop.py: docs/ADOPTING.md's loop on runtime.PlannedRun, re-planning at every
epoch end, 2 gloo ranks), and score the cause the run log's ``diagnosis`` names against the injected one.

Faults and the cause that is the right answer:

  cpu-hog       --hogs busy processes (cotenant.py --device cpu --duty 1) pinned to the rank's core -> cpu-cotenant
  loader        the rank's loader worker sleeps per sample                                        -> loader
  memory        EMULATED (the epoch-end state reports 2% free; each step passes over 256 MiB)     -> memory
  step          a sleep inside the step, between forward and backward                            -> inside-step
  gpu-cotenant  (--device cuda) benchmarks/cotenant.py on the rank's GPU                          -> gpu-cotenant
  none          nothing                                                                            -> none

Each rank runs on a core of its own (CPU) and one loader worker.  One profile and plan serve every run.  The fault's
rank (0 or 1) and first epoch (2 .. epochs-2) are drawn from ``--seed``; a run's epoch 0 is its warm-up (not
judged).  Per run: the cause named for the fault's rank at the first epoch from the fault on that names it (none:
never), the detection delay (that epoch - the fault's first), and false alarms (epochs before the fault that name
any rank, and from it on epochs that name the other rank).  A confusion table goes to stdout and one record per run
to ``--results`` as ``<cards>_faults_NN.json``.

examples:
  python benchmarks/fault_suite.py                               # 4 of each CPU fault + 5 without a fault
  python benchmarks/fault_suite.py --runs-per-fault 1 --no-fault-runs 1 --results /tmp/f   # a smoke run
  python benchmarks/fault_suite.py --device cuda --dry-run       # the GPU commands (2 GPUs), printed only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replan_midrun import CASES, Case, Group, base_env, device_names, make_plan, rank_cores, rank_envs, run_ranks
from summarize_bench import card_tag, fault_confusion

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
RANK_SCRIPT = Path(__file__).resolve().parent / "_fault_own_loop.py"
COTENANT = Path(__file__).resolve().parent / "cotenant.py"
EXPECTED = {"none": "none", "cpu-hog": "cpu-cotenant", "loader": "loader", "memory": "memory", "step": "inside-step",
            "gpu-cotenant": "gpu-cotenant"}
"""Injected fault -> the cause the diagnosis should name."""
CPU_FAULTS = ("cpu-hog", "loader", "memory", "step")
GPU_FAULTS = ("gpu-cotenant", "cpu-hog", "loader", "step")

CPU_CASE = Case(name="faults", devices=("cpu", "cpu"), model="cifar_cnn", global_batch=32, num_samples=480,
                pin_cores=True, launch_timeout_s=120.0,
                profile_args=("--dataset", "fake", "--no-loader", "--batch-sizes", "8,16,24,32"))
GPU_CASE = Case(name="faults-cuda", devices=("cuda:0", "cuda:1"), model="resnet18", global_batch=256,
                num_samples=10240, image_size=32, launch_timeout_s=180.0, profile_args=("--dataset", "fake", "--no-loader", "--quick"))
_ = CASES  # the mid-run re-plan cases this suite's launch helpers come from


@dataclass
class Run:
    index: int
    fault: str
    fault_rank: int
    fault_epoch: int | None
    command: str = ""
    rc: int = 0
    timed_out: bool = False
    wall_s: float = 0.0
    epochs: list[dict[str, Any]] = field(default_factory=list)
    scores: dict[str, Any] = field(default_factory=dict)
    load_avg: float | None = None
    """The host's 1-minute load average when the run started (other jobs on the box)."""


def schedule(faults: Sequence[str], per_fault: int, no_fault: int, epochs: int, seed: int) -> list[Run]:
    """The runs, interleaved (a drift of the box's load spreads over every fault alike), each fault's rank and first
    epoch drawn from ``seed``."""
    rng = random.Random(seed)
    kinds = [f for _ in range(per_fault) for f in faults] + ["none"] * no_fault
    rng.shuffle(kinds)
    return [Run(index=i + 1, fault=f, fault_rank=rng.randrange(2),
                fault_epoch=None if f == "none" else rng.randint(2, epochs - 2)) for i, f in enumerate(kinds)]


def score(run: Run) -> dict[str, Any]:
    """What the run log's diagnoses named (module docstring)."""
    named, detected, false_alarms = "none", None, []
    for e in run.epochs:
        ep = int(e["epoch"])
        diag = e.get("diagnosis") or []
        before = run.fault_epoch is None or ep < run.fault_epoch
        if before and diag:
            false_alarms.append({"epoch": ep, "ranks": [d["rank"] for d in diag], "causes": [d["cause"] for d in diag]})
            continue
        if before:
            continue
        others = [d for d in diag if d["rank"] != run.fault_rank]
        if others:
            false_alarms.append({"epoch": ep, "ranks": [d["rank"] for d in others],
                                 "causes": [d["cause"] for d in others]})
        hit = next((d for d in diag if d["rank"] == run.fault_rank), None)
        if hit is not None and detected is None:
            named, detected = hit["cause"], ep
    expected = EXPECTED[run.fault]
    return {"expected": expected, "named": named, "correct": named == expected,
            "detected_epoch": detected,
            "delay_epochs": None if detected is None or run.fault_epoch is None else detected - run.fault_epoch,
            "false_alarms": false_alarms, "crashed": run.rc != 0}


def read_epochs(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and d.get("event") == "start":
            out = []
        elif isinstance(d, dict) and d.get("event") == "epoch":
            out.append(d)
    return out


def _busy(st: dict[str, Any]) -> float | None:
    from planner.stats import StepStats

    try:
        return StepStats.from_dict(st).busy_s
    except Exception:
        return None


def compact_epoch(e: dict[str, Any]) -> dict[str, Any]:
    """The record's view of one epoch: the split, the prediction, each rank's measured own time, the diagnosis."""
    ranks = sorted(e.get("ranks") or [], key=lambda s: s.get("rank", 0))
    busy = [_busy(s) for s in ranks]
    return {"epoch": e["epoch"], "batch_sizes": e.get("batch_sizes"),
            "predicted_s": [None if p is None else round(p, 5) for p in e.get("predicted_step_time_s") or []],
            "measured_s": [None if b is None else round(b, 5) for b in busy],
            "diagnosis": [{"rank": d["rank"], "cause": d["cause"],
                           "error": round(d["measured_s"] / d["predicted_s"] - 1, 3) if d["predicted_s"] else None}
                          for d in e.get("diagnosis") or []]}


def write_record(run: Run, meta: dict[str, Any], out: Path) -> Path:
    stem = f"{card_tag(meta['devices'])}_faults"
    out.mkdir(parents=True, exist_ok=True)
    n = 1
    while (out / f"{stem}_{n:02d}.json").exists():
        n += 1
    rec = {"record": 1, "kind": "faults", "source": f"run_{run.index}/run.jsonl (temporary; not kept)",
           "command": run.command, "meta": meta, "fault": run.fault, "fault_rank": run.fault_rank,
           "fault_epoch": run.fault_epoch, "load_avg_1m_at_start": run.load_avg, "rc": run.rc, "wall_s": round(run.wall_s, 1), "scores": run.scores,
           "epochs": [compact_epoch(e) for e in run.epochs]}
    path = out / f"{stem}_{n:02d}.json"
    path.write_text(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n", encoding="utf-8")
    return path


def rank_command(case: Case, run: Run, plan: Path, profile: Path, log: Path, start_file: Path, epochs: int,
                 seed: int) -> list[str]:
    return [sys.executable, str(RANK_SCRIPT), "--plan", str(plan), "--profile", str(profile), "--log-file", str(log),
            "--model", case.model, "--num-samples", str(case.num_samples), "--epochs", str(epochs),
            "--devices", ",".join(case.devices), "--fault", run.fault, "--fault-rank", str(run.fault_rank),
            "--fault-epoch", str(run.fault_epoch if run.fault_epoch is not None else epochs),
            "--start-file", str(start_file), "--seed", str(seed),
            *(["--image-size", str(case.image_size)] if case.image_size else [])]


def cotenant_command(case: Case, run: Run, start_file: Path) -> list[str] | None:
    """The co-tenant a cpu-hog or gpu-cotenant run starts before its ranks (waiting on ``start_file``)."""
    if run.fault == "cpu-hog":
        return [sys.executable, str(COTENANT), "--device", "cpu", "--duty", "1", "--start-file", str(start_file)]
    if run.fault == "gpu-cotenant":
        return [sys.executable, str(COTENANT), "--device", case.devices[run.fault_rank], "--duty", "0.8",
                "--start-file", str(start_file)]
    return None


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: 2 GPUs, the GPU faults")
    p.add_argument("--runs-per-fault", type=int, default=4)
    p.add_argument("--no-fault-runs", type=int, default=5)
    p.add_argument("--faults", default=None, help="comma-separated subset of the device's faults")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--hogs", type=int, default=4,
                   help="cpu-hog: busy processes pinned to the rank's core (4: a clear share of a core that other "
                        "jobs already load)")
    p.add_argument("--seed", type=int, default=0, help="draws each run's fault rank and first epoch")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--no-records", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the schedule and the commands; run nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the ranks and the co-tenant
    case = GPU_CASE if args.device == "cuda" else CPU_CASE
    faults = tuple(f.strip() for f in (args.faults or ",".join(GPU_FAULTS if args.device == "cuda" else CPU_FAULTS))
                   .split(",") if f.strip())
    if any(f not in EXPECTED or f == "none" for f in faults) or args.epochs < 4:
        print(f"--faults: choose from {', '.join(f for f in EXPECTED if f != 'none')}; --epochs >= 4", file=sys.stderr)
        return 2
    runs = schedule(faults, args.runs_per_fault, args.no_fault_runs, args.epochs, args.seed)
    if args.dry_run:
        tmp = Path(tempfile.gettempdir()) / "fault_suite_DRY"
        profile, plan = tmp / "profile.json", tmp / "plan.json"
        for run in runs:
            start = tmp / f"run_{run.index}" / "go"
            co = cotenant_command(case, run, start)
            print(f"run {run.index}: {run.fault} on rank {run.fault_rank} from epoch {run.fault_epoch}; "
                  f"expected {EXPECTED[run.fault]}")
            if co:
                print(f"  co-tenant: {shlex.join(co)}")
            print(f"  ranks: {shlex.join(rank_command(case, run, plan, profile, tmp / 'run.jsonl', start, args.epochs, args.seed))}")
        return 0
    import torch  # only once the arguments are good: --help stays fast

    tmp = Path(tempfile.mkdtemp(prefix="fault_suite_"))

    print(f"{len(runs)} runs ({', '.join(faults)} x {args.runs_per_fault}, none x {args.no_fault_runs}), "
          f"{args.epochs} epochs each; logs in {tmp}", flush=True)
    profile, plan, plan_cmd = make_plan(case, tmp, case.launch_timeout_s)
    cores = rank_cores(case)
    meta = {"devices": device_names(profile), "rank_devices": list(case.devices), "model": case.model,
            "global_batch": case.global_batch, "num_samples": case.num_samples, "epochs": args.epochs,
            "seed": args.seed, "hogs": args.hogs, "torch": torch.__version__, "python": platform.python_version(),
            "host_cores": os.cpu_count(), "rank_cores": [sorted(c) if c else None for c in cores],
            "plan_command": plan_cmd,
            "memory_fault": "emulated (state reports 2% free; passes over 256 MiB for about a step, each step)",
            "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip() or None,
            "start_batch_sizes": [r["batch_size"] for r in json.loads(plan.read_text())["ranks"]]}
    for run in runs:
        d = tmp / f"run_{run.index}"
        d.mkdir()
        log, start = d / "run.jsonl", d / "go"
        cmd = rank_command(case, run, plan, profile, log, start, args.epochs, args.seed)
        run.command = shlex.join(cmd)
        run.load_avg = round(os.getloadavg()[0], 2)
        co, hog = cotenant_command(case, run, start), Group()
        if co is not None:
            env = base_env()
            env["OMP_NUM_THREADS"] = "1"
            for k in range(args.hogs if run.fault == "cpu-hog" else 1):
                hog.start(co, env, d / f"cotenant{k}.out", cores[run.fault_rank] if args.device == "cpu" else None)
        try:
            run.rc, run.timed_out, run.wall_s = run_ranks([cmd] * 2, rank_envs(case, cores), cores, d,
                                                          case.launch_timeout_s)
        finally:
            hog.stop()
        run.epochs = read_epochs(log)
        run.scores = score(run)
        s = run.scores
        print(f"run {run.index}: {run.fault} on rank {run.fault_rank} from epoch {run.fault_epoch}: named "
              f"{s['named']} at epoch {s['detected_epoch']} ({'right' if s['correct'] else 'WRONG'}), "
              f"{len(s['false_alarms'])} false alarm(s), rc {run.rc}, {run.wall_s:.0f} s", flush=True)
        if run.rc != 0:
            print((d / "rank0.out").read_text(errors="replace")[-2000:], flush=True)
        for e in run.epochs:
            for x in e.get("diagnosis") or []:
                print(f"  epoch {e['epoch']}: rank {x['rank']} {x['cause']} "
                      f"({x['measured_s'] / x['predicted_s'] - 1:+.0%}) {x['evidence'][:160]}", flush=True)
        if not args.no_records:
            print(f"  wrote {write_record(run, meta, args.results)}", flush=True)
    recs = [{"meta": meta, "fault": r.fault, "scores": r.scores} for r in runs]
    print()
    print(fault_confusion(recs))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
