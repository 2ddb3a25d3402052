"""Is a plan ever slower than leaving a rank out -- and does `planner plan` say so?

One launch set, in this order, all on this machine:

  1. ``planner bench --rank-devices cuda:0,cpu`` (the two-rank case: a GPU rank beside a CPU rank over gloo),
     ``--strategies equal,plan``, ``--rounds R``: the equal split (the stock baseline) and the plan, interleaved,
     with the profile written out;
  2. ``planner plan`` on that profile: the line naming the rank to leave out (``planner.solve.subset_line``), its
     predicted gain and the launch;
  3. the recommended launch: ``planner bench --nproc 1 --device cuda --strategies plan --rounds R`` (the GPU rank
     alone at the whole global batch).

The record (``--results``, one JSON per launch set, ``<cards>_<model>_leave-out_NN.json``) holds each strategy's
samples/s per round, the medians, the recommended launch over the two-rank plan (median ratio, and the min-max of
the per-round ratios in round order), the printed line and its predicted gain, and the prediction error of the
one-rank launch (measured / predicted - 1).

    python benchmarks/subset_check.py --model resnet18 --image-size 32 --global-batch 256 --rounds 3
    python benchmarks/subset_check.py --dry-run      # the same on CPU ranks (cpu,cpu): mechanics only, no GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=None, help="timed steps per strategy (bench's default)")
    p.add_argument("--timeout", type=float, default=280.0, help="seconds each bench may run")
    p.add_argument("--results", default=str(REPO / "docs" / "results"), help="folder for the record")
    p.add_argument("--work", default=None, help="folder for the raw files (default: a temporary one)")
    p.add_argument("--code", default=None, help="the commit the run measures (recorded)")
    p.add_argument("--dry-run", action="store_true", help="CPU ranks instead of cuda:0 (mechanics only)")
    return p


def _planner(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "planner", *args]
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True, timeout=timeout + 30)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"{' '.join(args[:1])} failed (rc {proc.returncode})")
    return proc


def _next_record(folder: Path, stem: str) -> Path:
    n = 1
    while (folder / f"{stem}_{n:02d}.json").exists():
        n += 1
    return folder / f"{stem}_{n:02d}.json"


def _cards(meta: dict[str, Any]) -> str:
    names = meta.get("devices") or []
    gpus = sum(1 for d in names if "H200" in d or "NVIDIA" in d)
    cpus = len(names) - gpus
    gpu = "h200" if any("H200" in d for d in names) else "gpu"
    return "-".join(p for p in ([f"{gpu}x{gpus}"] if gpus else []) + ([f"cpux{cpus}"] if cpus else []))


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="subset_check_"))
    work.mkdir(parents=True, exist_ok=True)
    devices = "cpu,cpu" if args.dry_run else "cuda:0,cpu"
    common = ["--model", args.model, "--image-size", str(args.image_size), "--global-batch", str(args.global_batch),
              "--rounds", str(args.rounds), "--timeout", str(args.timeout), "--quiet",
              *(["--steps", str(args.steps)] if args.steps else [])]
    profile, two_json, one_json = work / "profile.json", work / "two.json", work / "one.json"
    _planner("bench", "--rank-devices", devices, "--strategies", "equal,plan", "--profile-out", str(profile),
             "--json", str(two_json), *common, timeout=args.timeout)
    shown = _planner("plan", "--profile", str(profile), "--global-batch", str(args.global_batch),
                     "--out", str(work / "plan.json"), timeout=120)
    line = next((ln.strip() for ln in (shown.stdout + shown.stderr).splitlines() if "leaving out" in ln), None)
    gain = float(m.group(1)) if line and (m := re.search(r"predicted ([\d.]+)x faster", line)) else None
    one_dev = ["--device", "cpu"] if args.dry_run else ["--device", "cuda"]
    _planner("bench", "--nproc", "1", *one_dev, "--strategies", "plan", "--json", str(one_json), *common,
             timeout=args.timeout)
    two, one = json.loads(two_json.read_text()), json.loads(one_json.read_text())

    def rounds(result: dict[str, Any], strategy: str) -> list[float]:
        s = result[strategy]
        return [float(x) for x in s.get("rounds_samples_per_s") or [s["samples_per_s"]]]

    eq, plan2, alone = rounds(two, "equal"), rounds(two, "plan"), rounds(one, "plan")
    ratios = [a / p for a, p in zip(alone, plan2)]
    predicted_alone = one["meta"]["plan"]["predicted"]["samples_per_s"]
    predicted_two = two["meta"]["plan"]["predicted"]["samples_per_s"]
    rec = {
        "record": 1, "kind": "leave-out",
        "code": args.code, "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "meta": {"model": args.model, "image_size": args.image_size, "global_batch": args.global_batch,
                 "rank_devices": devices.split(","), "devices": two.get("meta", {}).get("devices"),
                 "torch": two.get("meta", {}).get("torch"), "rounds": args.rounds,
                 "heterogeneity": "real: a CUDA rank beside a CPU rank over gloo" if not args.dry_run else
                 "dry run: two CPU ranks"},
        "two_ranks": {"equal_samples_per_s": eq, "plan_samples_per_s": plan2,
                      "plan_batch_sizes": two["plan"]["batch_sizes"], "plan_predicted_samples_per_s": predicted_two,
                      "plan_prediction_error": statistics.median(plan2) / predicted_two - 1,
                      "plan_vs_equal_median": statistics.median(p / e for p, e in zip(plan2, eq))},
        "printed": line, "predicted_gain": gain,
        "alone": {"samples_per_s": alone, "predicted_samples_per_s": predicted_alone,
                  "prediction_error": statistics.median(alone) / predicted_alone - 1},
        "alone_vs_two_rank_plan": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    stem = f"{_cards(two.get('meta', {})) or 'cpux2'}_{args.model}_leave-out"
    out = _next_record(Path(args.results), stem)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec["alone_vs_two_rank_plan"]), "printed:", line)
    print(f"wrote {os.path.relpath(out, REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
