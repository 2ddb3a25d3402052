"""Summarize benchmarks/loader_gpu.sh's launches: per epoch measured vs predicted, per-rank errors, re-plans.

    python benchmarks/loader_summary.py OUT_DIR [--out summary.json]

Reads every ``<case>_r<i>_run.jsonl`` (with its ``_profile.json`` when present) in OUT_DIR.  Per launch and epoch:
the plan in effect (the start plan or the last adopted re-plan, matched by fingerprint), its predicted samples/s,
the measured samples/s and their ratio (and the wall clock's: the epoch's samples over its loop's wall seconds,
first batch's wait and warm-up included, from logs that record it), and each rank's error (own busy time, ``StepStats.busy_s``, against the
plan's per-rank step time: the report's run-log table).  Per launch: the median ratio over epochs >= 2, the worst
rank's median error over epochs >= 2 (leaving out epochs wholly in the loaders' drain, ``drain_epochs``: a streamed
run's last epochs, at the GPUs' pace), the wall ratio over those of them with no fill or drain step at all
(``clean_wall_ratio``; nor the refill that starts an adopted re-plan's stream), the epoch of the first adopted re-plan and its predicted gain, how many times
the plan changed, the profile's loader costs (each rank's own reading and the spread its host saw), and per epoch
(from epoch 1) the measured step against the model fed with that epoch's own measurements (``_inputs_model``).  Per case:
medians with min-max over the launches, the issue's acceptance numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from planner.plan import Plan
from planner.runlog import RunLog, read_run_log

STEADY_FROM_EPOCH = 2
"""The acceptance reads epochs >= 2 (the Replanner may act after epochs 0 and 1)."""


def _plans(log: RunLog) -> dict[str, Plan]:
    plans = {} if log.start_plan is None else {log.start_plan.fingerprint: log.start_plan}
    for r in log.replans:
        if r.adopted and r.plan is not None:
            plans[r.plan.fingerprint] = r.plan
    return plans


def launch_summary(log: RunLog, profile: dict[str, Any] | None) -> dict[str, Any]:
    plans = _plans(log)
    epochs: list[dict[str, Any]] = []
    # the first epoch of an adopted re-plan starts a new loader stream, whose workers refill from nothing
    # (planner.cli.steps.StreamedEpochs): like epoch 0's fill, not a steady reading (session 13: 0.570 by the wall)
    refills = log.plan_starts() - {log.epochs[0].epoch} if log.epochs else set()
    for e in log.epochs:
        plan = plans.get(e.plan_fingerprint)
        pred = plan.predicted.samples_per_s if plan is not None else None
        errors = [(b - p) / p if p > 0 else None for b, p in zip(e.measured_busy_s, e.predicted_step_time_s,
                                                                   strict=False)]
        epochs.append({
            "epoch": e.epoch, "batch_sizes": list(e.batch_sizes), "measured_samples_per_s": e.samples_per_s,
            "predicted_samples_per_s": pred,
            "ratio": e.samples_per_s / pred if pred and e.samples_per_s is not None else None,
            # by the wall clock: the first batch's wait and the warm-up steps the step timer leaves out, counted
            "wall_ratio": e.wall_samples_per_s / pred if pred and e.wall_samples_per_s else None,
            "rank_errors": errors, "loader_paced": [s.loader_paced for s in e.ranks],
            "data_wait_s": list(e.measured_data_wait_s), "compute_s": list(e.measured_compute_s),
            "step_time_s": list(e.measured_step_time_s),
            # the epoch start the steady step leaves out (runtime.timing: the loaders' pipeline fill)
            "fill_steps": max((s.fill_steps for s in e.ranks), default=0),
            "refill": e.epoch in refills,
            "fill_excess_s": max((s.fill_excess_s for s in e.ranks), default=0.0),
            # wholly in the loaders' drain (a streamed run's last epochs): the GPUs' pace, not the loaders'
            "drain": e.drained,
            # steps of it in the drain: the wall clock counts them (the timer does not), so the wall ratio of an
            # epoch with some is flattered (session 12: 97-102 ms steps in the drain against 108-117 before it)
            "drain_steps": e.drain_steps,
            **_inputs_model(e),
        })
    steady = [x for x in epochs if x["epoch"] >= STEADY_FROM_EPOCH and not x["drain"]]
    ratios = [x["ratio"] for x in steady if x["ratio"] is not None]
    inputs = [x["inputs_model_error"] for x in epochs if x["epoch"] >= 1 and x["inputs_model_error"] is not None]
    # per-rank errors over the clean steady epochs when there are some (no drain step: there a loader-paced rank
    # runs at the GPUs' pace, session 13: rank 1 at -14 to -18% in a 112-of-120-step drain epoch), else all steady
    clean = [x for x in steady if not x["drain_steps"] and not x["fill_steps"] and not x["refill"]]
    judged = clean or steady
    per_rank = list(zip(*[x["rank_errors"] for x in judged], strict=False)) if judged else []
    rank_err = [statistics.median(abs(v) for v in errs if v is not None) for errs in per_rank
                if any(v is not None for v in errs)]
    adopted = [r for r in log.replans if r.adopted and not r.reverted]
    out: dict[str, Any] = {
        "epochs": epochs,
        "replans": [{"epoch": r.epoch, "event": r.event, "adopted": r.adopted, "predicted_gain": r.predicted_gain,
                     "old_batch_sizes": list(r.old_batch_sizes), "new_batch_sizes": list(r.new_batch_sizes),
                     "reason": r.reason} for r in log.replans],
        "start_batch_sizes": list(log.start_plan.batch_sizes) if log.start_plan is not None else None,
        "start_bottlenecks": [r.bottleneck for r in log.start_plan.ranks] if log.start_plan is not None else None,
        "steady_ratio_median": statistics.median(ratios) if ratios else None,
        "steady_wall_ratio_median": statistics.median(w) if (w := [x["wall_ratio"] for x in steady
                                                                    if x["wall_ratio"] is not None]) else None,
        # by the wall clock over the steady epochs with no step of fill or drain at all: what a longer run's
        # middle epochs measure (None when every steady epoch holds some, e.g. 3 epochs streamed)
        "clean_wall_ratio_median": statistics.median(c) if (c := [
            x["wall_ratio"] for x in clean if x["wall_ratio"] is not None]) else None,
        "inputs_model_errors": inputs,
        "steady_rank_error_max": max(rank_err) if rank_err else None,
        "steady_rank_errors": rank_err,
        "rank_error_epochs": [x["epoch"] for x in judged],
        "first_adoption_epoch": adopted[0].epoch if adopted else None,
        "first_adoption_gain": adopted[0].predicted_gain if adopted else None,
        "plan_changes": len(adopted),
        "steady_fill_excess_s": [x["fill_excess_s"] for x in steady if x["fill_steps"]],
        "drain_epochs": [x["epoch"] for x in epochs if x["drain"]],
    }
    if profile is not None:
        ranks = profile.get("ranks", [])
        own = [r.get("meta", {}).get("loader_own_sec_per_sample", (r.get("loader") or {}).get("sec_per_sample"))
               for r in ranks]
        out["loader"] = {
            "sec_per_sample": [(r.get("loader") or {}).get("sec_per_sample") for r in ranks],
            "own_sec_per_sample": own,
            "own_spread": (max(own) - min(own)) / min(own) if own and all(own) else None,
            "host_spread": [r.get("meta", {}).get("loader_host_spread") for r in ranks],
            "max_workers": [(r.get("loader") or {}).get("max_workers") for r in ranks],
        }
    return out


def _inputs_model(e: Any) -> dict[str, Any]:
    """The model fed with the epoch's own measurements: the step as the largest over ranks of the median compute
    and the loader's period (build time over the workers), and the measured step against it (measured / that - 1).
    Near 0 while the plan's own prediction misses: the inputs (a drifting loader) moved, not the model's structure."""
    own = [max(s.compute_s_median or s.compute_s, s.loader_period_s or 0.0) for s in e.ranks]
    step = max(own) if own else 0.0
    return {"inputs_model_step_s": step or None,
            "inputs_model_error": e.step_time_s / step - 1.0 if step > 0 and e.step_time_s else None}


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def case_summary(launches: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(key: str) -> list[float]:
        return [float(x[key]) for x in launches if x.get(key) is not None]

    return {
        "launches": len(launches),
        "steady_ratio": _spread(pick("steady_ratio_median")),
        "steady_wall_ratio": _spread(pick("steady_wall_ratio_median")),
        "clean_wall_ratio": _spread(pick("clean_wall_ratio_median")),
        "steady_rank_error_max": _spread(pick("steady_rank_error_max")),
        "first_adoption_epoch": [x["first_adoption_epoch"] for x in launches],
        "first_adoption_gain": [x["first_adoption_gain"] for x in launches],
        "plan_changes": [x["plan_changes"] for x in launches],
        "inputs_model_error": _spread([v for x in launches for v in x.get("inputs_model_errors", [])]),
        "fill_excess_s": _spread([v for x in launches for v in x.get("steady_fill_excess_s", [])]),
        "loader_own_spread": _spread([float(x["loader"]["own_spread"]) for x in launches
                                      if x.get("loader") and x["loader"].get("own_spread") is not None]),
    }


def summarize(out_dir: Path) -> dict[str, Any]:
    launches: dict[str, dict[str, Any]] = {}
    for run in sorted(out_dir.glob("*_run.jsonl")):
        tag = run.name[: -len("_run.jsonl")]
        prof = run.with_name(f"{tag}_profile.json")
        try:
            log = read_run_log(run)
        except Exception as e:  # a launch that died early: say so, keep the others
            launches[tag] = {"error": f"{type(e).__name__}: {e}"}
            continue
        launches[tag] = launch_summary(log, json.loads(prof.read_text()) if prof.exists() else None)
    cases: dict[str, list[dict[str, Any]]] = {}
    incomplete: dict[str, list[str]] = {}
    for tag, s in launches.items():
        case = tag.rsplit("_r", 1)[0]
        if "error" in s or not any(e["epoch"] >= STEADY_FROM_EPOCH for e in s["epochs"]):
            incomplete.setdefault(case, []).append(tag)  # stopped before its steady epoch: counted apart
            continue
        cases.setdefault(case, []).append(s)
    summary = {c: case_summary(v) for c, v in cases.items()}
    for case, tags in incomplete.items():
        summary.setdefault(case, {"launches": 0})["incomplete"] = tags
    return {"kind": "loader_gpu_summary", "steady_from_epoch": STEADY_FROM_EPOCH, "cases": summary,
            "launches": launches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, help="folder with <case>_r<i>_run.jsonl files")
    p.add_argument("--out", type=Path, default=None, help="write the summary JSON here (default: stdout)")
    args = p.parse_args(argv)
    summary = summarize(args.out_dir)
    text = json.dumps(summary, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
        for case, c in summary["cases"].items():
            print(f"{case}: {json.dumps({k: v for k, v in c.items()})}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
