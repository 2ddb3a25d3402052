"""`planner bench`: equal split vs proportional vs plan vs plan+replan vs ideal, side by side in one launch.

It launches its own ranks (spawn, FileStore rendezvous, a deadline, children killed on exit), profiles them
in-process, then runs every strategy back to back on the same ranks, same model, data and global batch:

  equal         torch DistributedSampler + BatchSampler + plain DDP (what users run today)
  proportional  batch proportional to each rank's throughput measured at the equal batch (the DBS/timm heuristic)
  plan          planner.solve on the profile, HeteroBatchSampler + weighted gradient hook
  plan+replan   the plan with re-planning each epoch; `--late-slowdown R=F` slows rank R from epoch 1 on
  ideal         B / (B / sum_i b_i / t_i(b_i) + e): each rank's standalone throughput at its planned batch,
                measured in the same launch with no communication (nobody waits for anybody), plus the plan's
                all-reduce tail e that no split of these ranks avoids (``ideal_with_tail``); t_i is never above
                the rank's step in a run of the same split (``bounded_ideal``), and e never puts the ideal below
                such a run, so no run beats it and "vs ideal" is the fraction of what these ranks can reach

Every number comes from this one launch, so the ratios compare like with like.  The kind of heterogeneity is
recorded in the JSON (`meta.heterogeneity`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.argcheck import GPU_NORMALIZE_CHOICES, count, real
from planner.cli.advanced import add_help_all
from planner.cli.bench_options import DATA, DEFAULT_STRATEGIES, STRATEGIES, BenchOptions

if TYPE_CHECKING:
    from planner.cli.bench_window import TimedWindow

HELP = "compare equal split, proportional, plan and re-plan side by side"
EPILOG = """\
examples:
  planner bench --device cpu --nproc 2 --emulate-slowdown 1=3 --json out.json
  planner bench --device cuda --nproc 2 --model resnet50 --amp --global-batch 512 --emulate-slowdown 1=3
  planner bench --device cuda --nproc 2 --data loader --emulate-loader 1=2 --global-batch 512   # loader skew
  planner bench --rank-devices cuda:0,cpu --model resnet18 --image-size 64 --global-batch 128   # CUDA + CPU

--help-all also lists the advanced options: --sweep-slowdown, --emulate-memory, --step-log, --profile-out, ...
"""
PREDICTION_TOL = 0.15
"""A measured plan step this far from its prediction is flagged (the same bar as the report's finding)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    adv = add_help_all(p)
    p.add_argument("--nproc", type=count(1, 1024), default=2, metavar="N", help="ranks to launch on this host (default 2)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto, cpu or cuda (rank i -> cuda:i)")
    p.add_argument("--rank-devices", default=None, metavar="LIST", help="one device per rank, e.g. cuda:0,cpu")
    p.add_argument("--model", default=None, metavar="M",
                   help="model spec (default: resnet50 on CUDA, cifar_cnn on CPU)")
    p.add_argument("--dataset", default="fake", metavar="D", help="dataset spec for --data loader (default fake)")
    p.add_argument("--data", choices=DATA, default="device",
                   help="device: synthetic batches on the device (isolates compute); loader: the real DataLoader")
    p.add_argument("--image-size", type=count(), default=None, metavar="PX", help="input side (fake data)")
    p.add_argument("--num-samples", type=count(), default=None, metavar="N", help="dataset length")
    p.add_argument("--global-batch", type=count(), default=None, metavar="B",
                   help="global batch (default 512 on CUDA, 64 on CPU); a multiple of the rank count")
    p.add_argument("--steps", type=count(), default=None, metavar="N",
                   help="timed steps per strategy and epoch (default 30 on CUDA, 15 on CPU); with --data loader "
                        "one epoch, timed after workers x 5 steps spend the batches built ahead by any rank whose "
                        "loader is predicted at half its step or more")
    p.add_argument("--rounds", type=count(), default=1, metavar="N",
                   help="run the strategies N times, interleaved, and report each one's median round (default 1)")
    p.add_argument("--replan-epochs", type=count(), default=4, metavar="E", help="epochs of plan+replan (default 4)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--quick", action="store_true", help="a short profile")
    p.add_argument("--emulate-slowdown", default=None, metavar="R=F,..", help="rank R does F x its compute")
    p.add_argument("--emulate-loader", default=None, metavar="R=W,..", help="cap rank R's loader workers at W")
    p.add_argument("--late-slowdown", default=None, metavar="R=F,..",
                   help="plan+replan only: rank R becomes F x slower from its second epoch (default: none)")
    p.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES), metavar="LIST",
                   help=f"subset of {','.join(STRATEGIES)} (ideal is always measured)")
    p.add_argument("--timeout", type=real(0.0, lo_open=True), default=1800.0, metavar="S", help="kill every rank after S seconds")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write all numbers here (while it runs, the runs so far are in PATH.partial.json)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr (the results still print)")
    a = adv.group("advanced", "Variants of the comparison and what it records.")
    a.add_argument("--gpu-normalize", nargs="?", const="on", default="auto", choices=GPU_NORMALIZE_CHOICES,
                   help="--data loader, built-in image datasets: uint8 images normalized on the GPU, for every "
                        "strategy alike, as `planner train` does (auto: on when every rank is on CUDA)")
    a.add_argument("--emulate-memory", default=None, metavar="R=GIB,..",
                   help="emulate a smaller GPU: rank R may allocate only GIB GiB (real out-of-memory errors)")
    a.add_argument("--sweep-slowdown", default=None, metavar="SPEC;SPEC..",
                   help="run the whole comparison once per --emulate-slowdown spec, e.g. '1=1;1=2;1=3' "
                        "(JSON: {'runs': [...]})")
    a.add_argument("--loader-check-s", type=real(0.0, 600.0), default=None, metavar="S",
                   help="--data loader: seconds every rank runs the plan's DataLoader at once before the rounds, to "
                        "correct the loader costs as `planner train --auto` does (default 3, 1 with --quick; 0: no "
                        "check)")
    a.add_argument("--label", default=None, metavar="TEXT", help="name of the heterogeneity, stored in the JSON")
    a.add_argument("--profile-out", default=None, metavar="PATH", help="also write the profile used")
    a.add_argument("--step-log", default=None, metavar="PATTERN",
                   help="each rank's steps of each strategy and round, one JSON line an epoch (planner train's "
                        "--step-log), to PATTERN with {strategy}, {round} and {rank} filled in, e.g. "
                        "'steps_{strategy}_{round}_{rank}.jsonl'")


def run(args: argparse.Namespace) -> int:
    from planner.paths import Output, check_outputs

    # Checked before a single rank starts: a bad --json path found after the benchmark lost all of it.
    check_outputs([Output(flag="--json", path=args.json), Output(flag="--profile-out", path=args.profile_out),
                   Output(flag="--step-log", path=args.step_log and step_log_path(args.step_log, "equal", 1, 0))])
    opts = BenchOptions.from_args(args, cuda=_uses_cuda(args))
    _check_devices(opts)
    if opts.step_log:  # every file this bench appends to starts empty: never another run's step log
        from planner.paths import check_not_written

        for name in opts.strategies:
            for r in range(opts.rounds):
                for rank in range(opts.nproc):
                    check_not_written(step_log_path(opts.step_log, name, r + 1, rank), "--step-log")
    results = []
    for one in opts.runs():
        result = _launch(one)
        print(format_bench(result) + "\n", flush=True)
        results.append(result)
    if opts.json_path:
        from planner.jsonio import write_json_atomic

        write_json_atomic(opts.json_path, results[0] if len(results) == 1 else {"runs": results})
        Path(partial_path(opts.json_path)).unlink(missing_ok=True)
        print(f"wrote {opts.json_path}")
    return 0


def _check_devices(opts: BenchOptions) -> None:
    """Every rank's device, resolved here before any rank starts: a missing GPU is one line naming the flag typed,
    not a traceback from inside a spawned rank."""
    from planner.cli.distenv import rank_device_spec, resolve_device

    flag = f"--rank-devices {opts.rank_devices}" if opts.rank_devices else None
    for rank in range(opts.nproc):
        spec, _ = rank_device_spec(opts.device, opts.rank_devices, rank, opts.nproc)
        resolve_device(spec, rank, flag=flag)


def _uses_cuda(args: argparse.Namespace) -> bool:
    import torch

    if args.rank_devices:
        return "cuda" in args.rank_devices
    return args.device.startswith("cuda") or (args.device == "auto" and torch.cuda.is_available())


def _launch(opts: BenchOptions) -> dict[str, Any]:
    from planner.cli.launch import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            spawn(_worker, opts.nproc, (opts, out), timeout_s=opts.timeout_s, what="bench")
        except TimeoutError:
            raise RuntimeError(f"bench did not finish in {opts.timeout_s:.0f} s (raise --timeout)") from None
        with open(out, encoding="utf-8") as f:
            return dict(json.load(f))


def _worker(rank: int, nproc: int, store_path: str, opts: BenchOptions, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from planner.cli.distenv import init_from_env, shutdown
    from planner.cli.progress import Progress
    from profiler.workloads.emulate import cap_device_memory

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank)})
    # Every strategy and round trains again with the same set-up: its warnings and notes are said once a bench.
    sys.stderr = OnceLines(sys.stderr)  # type: ignore[assignment]
    env = init_from_env(opts.device, opts.rank_devices, timeout_s=300.0, store=dist.FileStore(store_path, nproc))
    if env.device.type == "cpu":
        # CPU ranks share the host: split its cores so they don't oversubscribe each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    try:
        cap_device_memory(env.device, opts.memory_gib(rank))
        # Rank 0 reports each phase (profile points, every strategy's epochs and steps) on the shared stderr.
        with Progress("bench", enabled=rank == 0 and not opts.quiet) as progress:
            result = _bench_rank(env, opts, opts.slowdown(rank), opts.late(rank), opts.loader_cap(rank), progress)
        if rank == 0:
            from planner.jsonio import write_json_atomic

            write_json_atomic(out_path, result)
        dist.barrier()
    finally:
        shutdown(env)
    # Done and written: skip interpreter teardown, where gloo's worker threads can abort a finished process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class OnceLines:
    """A text stream that passes each warning or note line (``warning:``, ``note:``, ``rank N: ...``) the first time
    only, and everything else as it comes.  `planner bench` runs the trainer once per strategy and round on the
    same ranks, and the trainer's set-up warnings (a short epoch for a rank's workers, a loader note) would
    otherwise print once per run, the same line each time."""

    PREFIXES = ("warning:", "note:", "rank ")

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.seen: set[str] = set()
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if line.startswith(self.PREFIXES):
                if line in self.seen:
                    continue
                self.seen.add(line)
            self.stream.write(line + "\n")
        if self.pending and not self.pending.startswith(self.PREFIXES):  # progress, a live line: as it comes
            self.stream.write(self.pending)
            self.pending = ""
        return len(text)

    def flush(self) -> None:
        if self.pending:  # a line not finished yet: out as it is
            self.stream.write(self.pending)
            self.pending = ""
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: the stream's
        return getattr(self.stream, name)


def partial_path(json_path: str) -> str:
    """Where a run in progress keeps what it measured so far: ``<--json>.partial.json``."""
    return f"{json_path}.partial.json"


def write_partial(path: str, opts: BenchOptions, profile_s: float, runs: dict[str, Any],
                  per_round: dict[str, list[dict[str, Any]]]) -> None:
    """Every strategy run measured so far, written after each one (atomically), so a bench stopped by a time
    limit still leaves its numbers (a GPU launch stopped at its limit otherwise leaves none).  The
    finished bench deletes it once --json is written; a partial file is never a result table's input."""
    from planner.jsonio import write_json_atomic

    write_json_atomic(path, {
        "complete": False,
        "why": "written after every strategy run of a bench that had not finished; the finished bench replaces it "
               "with --json",
        "options": opts.to_dict(),
        "profile_s": profile_s,
        "plans": {k: p.to_dict() for k, (p, _) in runs.items()},
        "rounds": per_round})


def window_drain_steps(plan: Any, near: float = 0.5) -> int:
    """Steps before a loader-fed window opens for this split: planner.cli.steps.loader_drain_steps of the most workers of
    any rank whose predicted loader time is at least ``near`` x the predicted step.  Such a rank may be loader-bound
    (the prediction can be off by tens of percent), and its prefetched batches would hide its loader; a rank whose
    loader needs under half the step never spends its buffer, so its workers need no drain."""
    from planner.cli.steps import loader_drain_steps

    bound = _near_loader_bound_workers(plan, near)
    return loader_drain_steps(max(bound)) if bound else 1


def step_log_path(pattern: str, strategy: str, round_: int, rank: int) -> str:
    """``--step-log``'s file for one strategy, round (from 1) and rank."""
    return pattern.replace("{strategy}", strategy).replace("{round}", str(round_)).replace("{rank}", str(rank))


def window_steps(plan: Any, steps: int, near: float = 0.5) -> int:
    """Steps in a loader-fed window for this split: ``steps`` rounded up to whole cycles of the workers of the
    ranks ``window_drain_steps`` drains for (runtime.timing.worker_cycle: the least common multiple of their
    worker counts when it is at most 4 x ``steps``, else the most workers).  Their workers deliver in bursts,
    and only whole cycles time their pace: on 2x H100 a 16-worker rank's 20-step windows read 2,687-3,470
    samples/s in three rounds of one split."""
    return whole_cycles(steps, _near_loader_bound_workers(plan, near))


def whole_cycles(steps: int, workers: list[int]) -> int:
    """``steps`` rounded up to whole cycles of these workers (runtime.timing.worker_cycle, within 4 x ``steps``)."""
    from runtime.timing import worker_cycle

    cycle = worker_cycle(workers, 4 * steps)
    return -(-steps // cycle) * cycle


def _near_loader_bound_workers(plan: Any, near: float) -> list[int]:
    """Workers of each rank whose predicted loader time is at least ``near`` x the split's predicted step."""
    step = plan.predicted.step_time_s
    return [r.num_workers for r in plan.ranks if r.num_workers > 0 and r.predicted_loader_s >= near * step]


def _bench_rank(env: Any, opts: BenchOptions, slow: float, late: float | None, cap: int | None,
                progress: Any) -> dict[str, Any]:
    import planner
    from planner.cli.autoplan import AutoPlanOptions, auto_plan
    from planner.cli.bench_window import TimedWindow
    from planner.cli.train import TrainConfig, channels_last_for, train
    from planner.errors import ValidationError
    from planner.quality import extrapolation_lines
    from planner.solve import equal_accumulation_split
    from profiler.workloads.emulate import Slowdown
    from profiler.workloads.specs import build_workload, gpu_normalize_for
    from runtime.collectives import all_gather_json

    on_device, mixed = opts.on_device, opts.mixed_devices
    # Fake data is made per index on demand: a long dataset costs nothing and leaves room for a loader-fed window.
    workload = build_workload(opts.model, opts.dataset, image_size=opts.image_size,
                              num_samples=opts.num_samples or 1_000_000,
                              gpu_normalize=not on_device and gpu_normalize_for(
                                  opts.gpu_normalize, opts.model, opts.dataset, ["cpu" if mixed else env.device.type]))
    B, W = opts.global_batch, env.world_size
    cl = channels_last_for(workload, env.device, mixed)  # as the trainer does
    base = TrainConfig(model=opts.model, dataset=opts.dataset, image_size=opts.image_size,
                       num_samples=opts.num_samples, epochs=2, max_steps_per_epoch=opts.steps,
                       amp=opts.amp, data_on_device=on_device, slowdown=slow, loader_workers_cap=cap,
                       quiet=True, lr=1e-4, mixed_devices=mixed, loader_check_s=opts.loader_check_s,
                       # A pass per epoch for every strategy, as the stock loop (the equal split) runs: the bench
                       # compares splits, not `planner train`'s loader across epochs (planner.cli.steps.StreamedEpochs).
                       restart_loader_each_epoch=True)
    progress.phase("profile")
    # What `planner train --auto` would hand the user, by the same pipeline (planner.cli.autoplan): the profile's
    # quality gate, the solve, and the loader check before the rounds; its notes go to stderr beside the warnings.
    auto = auto_plan(base, env, workload, AutoPlanOptions(global_batch=B, quick=opts.quick,
                                                          profile_out=opts.profile_out),
                     progress=progress, say=lambda line: print(line, file=sys.stderr, flush=True))
    plan, profile, quality, profile_s, loader_check = (auto.plan, auto.profile, auto.quality, auto.profile_s,
                                                       auto.loader_check)
    min_batch = workload.min_batch
    if env.is_main:
        for line in extrapolation_lines(plan, profile):
            print(line, file=sys.stderr, flush=True)
    equal = planner.evaluate(profile, planner.equal_split(B, W), min_batch=min_batch, method="equal")
    prop = planner.evaluate(profile, proportional_split(profile, B, min_batch), min_batch=min_batch,
                            method="proportional")
    out: dict[str, Any] = {}
    runs = {"equal": (equal, replace(base, strategy="equal")), "proportional": (prop, base), "plan": (plan, base)}
    if "equal-accum" in opts.strategies:
        runs["equal-accum"] = (equal_accumulation_split(profile, B, min_batch=min_batch), base)
    if "no-accum" in opts.strategies:
        try:
            runs["no-accum"] = (planner.solve(profile, global_batch=B, min_batch=min_batch, max_accumulation_steps=1,
                                              min_gain=0.0), base)
        except planner.PlanError as e:  # no split without accumulation fits: recorded as such
            out["no-accum"] = {"infeasible": str(e)}
    # A loader-fed window opens once the batches the workers built ahead are spent (planner.cli.steps.loader_drain_steps),
    # in one long epoch per strategy: after the prefetch of every rank that split's prediction puts near its loader's
    # pace (window_drain_steps; on 2x H100, draining every strategy for the plan's 16-worker rank put
    # the equal split's 2-worker rank through 80 extra 0.7 s steps a round, and the bench past 9 minutes).
    # Its window is whole cycles of those ranks' workers (window_steps), which deliver in bursts.
    open_after = {k: 1 for k in runs}
    if not on_device:
        open_after = {k: window_drain_steps(p) for k, (p, _) in runs.items()}
        timed = {k: window_steps(p, opts.steps) for k, (p, _) in runs.items()}
        need, n = max(open_after[k] + timed[k] for k in runs), len(workload.dataset)  # type: ignore[arg-type]
        if n // B < need:
            raise ValidationError(
                f"--data loader: the timed window opens after up to {max(open_after.values())} steps (the "
                f"batches the workers prefetch) and runs up to {max(timed.values())} more (whole cycles of the "
                f"workers), but {n} samples give {n // B} steps of {B}; give --num-samples {need * B} or more")
        runs = {k: (p, replace(c, epochs=1, max_steps_per_epoch=open_after[k] + timed[k]))
                for k, (p, c) in runs.items()}
        base = replace(base, max_steps_per_epoch=need)
    rounds = opts.rounds
    per_round: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):  # interleaved: every strategy once per round, so drift hits them alike
        for k, name in enumerate(opts.strategies, 1):
            if name == "plan+replan" or name not in runs:
                continue
            p, cfg = runs[name]
            prefix = f"round {r + 1}/{rounds}: " if rounds > 1 else ""
            progress.phase(f"{prefix}strategy {name} ({k}/{len(opts.strategies)}, batches {list(p.batch_sizes)})")
            window = TimedWindow(env.device, open_after[name])
            if opts.step_log:
                cfg = replace(cfg, step_log_path=step_log_path(opts.step_log, name, r + 1, env.rank))
            epochs = train(cfg, env, p, profile, workload, progress=progress, on_start=window.on_start,
                           on_step=window.on_step)
            # The first epoch warms up (allocator, cudnn autotune, workers); plain DDP has no hook to time compute.
            per_round.setdefault(name, []).append(_summary(epochs[-1], p, window, timed=name != "equal"))
            if env.is_main and opts.json_path:
                write_partial(partial_path(opts.json_path), opts, profile_s, runs, per_round)
    for name, summaries in per_round.items():
        # The round with the median throughput stands for the strategy; every round's number is kept.
        ranked = sorted(summaries, key=lambda x: x["samples_per_s"])
        out[name] = {**ranked[(len(ranked) - 1) // 2],
                     "rounds_samples_per_s": [x["samples_per_s"] for x in summaries],
                     "rounds_window": [x["window"] for x in summaries]}
    if "plan+replan" in opts.strategies:
        cfg = replace(base, epochs=opts.replan_epochs, replan=True, slowdown_late=late or slow,
                      slowdown_from_epoch=1)
        progress.phase(f"strategy plan+replan ({len(opts.strategies)}/{len(opts.strategies)})")
        window = TimedWindow(env.device, open_after.get("plan", max(open_after.values())))
        epochs = train(cfg, env, plan, profile, workload, progress=progress, on_start=window.on_start,
                       on_step=window.on_step)
        s = _summary(epochs[-1], plan, window)
        s["epochs"] = [{"epoch": e.epoch, "samples_per_s": e.samples_per_s, "step_time_s": e.step_time_s,
                        "batch_sizes": list(e.batch_sizes), "replan": e.replan} for e in epochs]
        out["plan+replan"] = s
    # ideal: each rank alone at its planned batch, no communication, measured now on the same ranks
    progress.phase("ideal (each rank alone at its planned batch)")
    if on_device:
        mine = _standalone_step_s(workload, env.device, plan.batch_sizes[env.rank], slow, opts, cl,
                                  plan.ranks[env.rank].accumulation_steps)
    else:
        w = plan.ranks[env.rank].num_workers if cap is None else min(cap, plan.ranks[env.rank].num_workers)
        mine = _standalone_loader_step_s(workload, env.device, plan.batch_sizes[env.rank], w, slow, opts, cl)
    measured_alone = all_gather_json(mine)
    same_split = [s["samples_per_s"] for s in out.values()
                  if s.get("samples_per_s") and s.get("batch_sizes") == list(plan.batch_sizes)]
    no_comm, alone, bounded = bounded_ideal(plan.batch_sizes, measured_alone, same_split)
    ideal, tail = ideal_with_tail(B, no_comm, plan.predicted.comm_s, same_split)
    out["ideal"] = {"samples_per_s": ideal, "standalone_step_time_s": alone, "batch_sizes": list(plan.batch_sizes),
                    "measured_standalone_step_time_s": measured_alone, "bounded_by_run": bounded,
                    "no_comm_samples_per_s": no_comm, "comm_tail_s": tail,
                    "predicted_samples_per_s": ideal_with_tail(B, plan.predicted.ideal_samples_per_s,
                                                               plan.predicted.comm_s, [])[0]}
    if env.is_main and bounded:
        read = ", ".join(f"rank {i} {1000 * measured_alone[i]:.1f} ms" for i in bounded)
        print(f"note: measured alone ({read}) slower than inside a synchronized run of the plan's split "
              f"({1000 * alone[bounded[0]]:.1f} ms a step); the ideal takes the run's step there, which a rank "
              "alone never exceeds", file=sys.stderr, flush=True)
    if opts.late_slowdown:  # the same condition on every rank: the gather below is a collective
        out["ideal"]["after_late_slowdown_samples_per_s"] = _after_slowdown_ideal(
            profile, B, min_batch, all_gather_json([slow, late or slow]))
    miss = out.get("plan", {}).get("predicted_error")
    if env.is_main and miss is not None and abs(miss) > PREDICTION_TOL:
        # The ratios below are measured and stand; the plan they measure was solved from a prediction this wrong.
        cause = "; the profile has quality warnings (above)" if quality.issues else ""
        print(f"warning: the plan's step measured {1000 * out['plan']['step_time_s']:.1f} ms against "
              f"{1000 * out['plan']['predicted_step_time_s']:.1f} ms predicted ({miss:+.0%}){cause}: its split may "
              f"not be the best; re-profile with a longer --budget-s on an idle machine", file=sys.stderr, flush=True)
    eq_sps = out.get("equal", {}).get("samples_per_s")
    acc_sps = out.get("equal-accum", {}).get("samples_per_s")
    for s in out.values():
        if "samples_per_s" not in s:
            continue  # a strategy that could not run (no-accum where nothing fits without accumulation)
        if eq_sps:
            s["vs_equal"] = s["samples_per_s"] / eq_sps
        if acc_sps:
            s["vs_equal_accum"] = s["samples_per_s"] / acc_sps
        s["vs_ideal"] = s["samples_per_s"] / ideal if ideal else None
    out["meta"] = {
        "world_size": W, "global_batch": B, "model": opts.model, "amp": opts.amp,
        "data": "synthetic on device (loader excluded)" if on_device else f"DataLoader over {opts.dataset}",
        # uint8 images normalized on the device (--gpu-normalize): a quarter of the loader's bytes
        "gpu_normalize": workload.normalize is not None,
        "devices": all_gather_json(_device_name(env.device)),
        "emulate_slowdown": opts.emulate_slowdown, "emulate_loader": opts.emulate_loader,
        "emulate_memory": opts.emulate_memory,
        # profiler.workloads.emulate's mode (PLANNER_EMULATE_MODE): where a slowed rank's extra passes run in its step.
        "emulate_mode": Slowdown().mode if opts.emulate_slowdown or opts.late_slowdown else None,
        "late_slowdown": opts.late_slowdown, "heterogeneity": opts.label or _label(opts),
        "steps_per_strategy": opts.steps, "profile_s": round(profile_s, 2), "torch": _torch_version(),
        # Which batches the profile measured on each rank: a prediction there is in-sample (summarize_bench.py).
        "profile_batch_sizes": [[p.batch_size for p in r.compute] for r in profile.by_rank],
        "plan": plan.to_dict(),
        # The loader check before the rounds (None: not run): what it measured, and whether the split moved.
        "loader_check": loader_check,
    }
    return out


def bounded_ideal(batch_sizes: Any, standalone_s: list[float],
                  runs_samples_per_s: list[float]) -> tuple[float, list[float], list[int]]:
    """(ideal samples/s, each rank's standalone step, the ranks whose step a run bounded): sum_i b_i / t_i, t_i rank
    i's step alone at its batch b_i.

    A rank alone never takes longer than it took inside a synchronized run of the same split, where it also waited
    for its peers: that run's step B / (its samples/s) bounds t_i from above.  A standalone measurement can read
    slower -- it runs at another moment than the strategies (a co-tenant's load moves), and it times each step
    synchronized where training overlaps one step's launches with the last's work -- so t_i is the smaller of the
    two.  Then the ideal is at least every run of that split: sum_i b_i / t_i >= sum_i b_i / step = B / step.
    """
    big_b = sum(int(b) for b in batch_sizes)
    run_step = min((big_b / sps for sps in runs_samples_per_s if sps > 0), default=float("inf"))
    alone = [min(float(t), run_step) for t in standalone_s]
    bounded = [i for i, t in enumerate(standalone_s) if float(t) > run_step]
    ideal = sum(int(b) / t for b, t in zip(batch_sizes, alone, strict=True) if t > 0)
    return ideal, alone, bounded


def ideal_with_tail(global_batch: int, no_comm_samples_per_s: float, tail_s: float,
                    runs_samples_per_s: list[float]) -> tuple[float, float]:
    """(ideal samples/s, the tail it charges): the ranks flat out at ``no_comm_samples_per_s`` (``bounded_ideal``)
    plus the all-reduce tail ``tail_s`` every step of these ranks pays after its slowest rank (the plan's exposed
    communication, ``Predicted.comm_s``; 0 on one rank).  The tail is cut to what the fastest run of the same split
    left over the flat-out step, so the ideal stays at least every run of that split."""
    if no_comm_samples_per_s <= 0:
        return 0.0, 0.0
    flat = global_batch / no_comm_samples_per_s
    run_step = min((global_batch / sps for sps in runs_samples_per_s if sps > 0), default=float("inf"))
    tail = max(0.0, min(float(tail_s), run_step - flat))
    return global_batch / (flat + tail), tail


def proportional_split(profile: Any, B: int, min_batch: int) -> list[int]:
    """Batch proportional to throughput at the equal batch (largest-remainder rounding, >= min_batch)."""
    from planner.curves import fit_envelope
    from planner.rounding import largest_remainder

    b_eq = B / profile.world_size
    speed = [b_eq / fit_envelope(r.compute)(b_eq) for r in profile.by_rank]
    return largest_remainder([B * s / sum(speed) for s in speed], B, lo=min_batch)


def _after_slowdown_ideal(profile: Any, B: int, min_batch: int, factors: list[list[float]]) -> float:
    """Predicted ideal throughput once the late slowdown is in force (profile curves rescaled by late/early)."""
    import planner

    scaled = profile.scaled([late / early for early, late in factors])
    # the physical limit: the optimum's ideal, not the equal split's that min_gain may keep
    return float(planner.solve(scaled, global_batch=B, min_batch=min_batch, min_gain=0.0).predicted.ideal_samples_per_s)


def _standalone_step_s(workload: Any, device: Any, b: int, slow: float, opts: BenchOptions, cl: bool,
                       accumulation_steps: int = 1) -> float:
    """Median full-step time of this rank alone at batch b (same step code as the profiler); with accumulation,
    its k micro-batches and one optimizer step, as the trainer runs them."""
    from planner.plan import micro_batch_sizes
    from profiler.compute import StepRunner

    runner = StepRunner(workload, device, amp=opts.amp, slowdown=slow, channels_last=cl)
    repeats = max(5, min(opts.steps, 15))
    try:
        if accumulation_steps <= 1:
            m = runner.measure(b, warmup=3, repeats=repeats)
            return float(statistics.median(m.times_s))
        batches = [runner.make_batch(n) for n in micro_batch_sizes(b, accumulation_steps)]
        times = []
        for i in range(3 + repeats):
            runner._sync()
            t0 = time.perf_counter()
            runner.micro_step(batches)
            runner._sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return float(statistics.median(times))
    finally:
        runner.close()


def _standalone_loader_step_s(workload: Any, device: Any, b: int, workers: int, slow: float,
                              opts: BenchOptions, cl: bool) -> float:
    """Mean step time of this rank alone at batch b fed by its own DataLoader with `workers` workers."""
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from planner.cli.steps import LOADER_PREFETCH, DeviceCopy, loader_drain_steps
    from profiler.compute import StepRunner

    runner = StepRunner(workload, device, amp=opts.amp, slowdown=slow, channels_last=cl)
    to_device = DeviceCopy(device, runner.channels_last, workload.normalize)  # uint8 images: normalized as training does
    # Timed once the workers' start-up and the batches they build ahead are spent, and over whole cycles of its
    # workers (runtime.timing.worker_cycle), as the strategies' windows are.
    steps, warmup = whole_cycles(max(5, min(opts.steps, 20)), [workers]), max(3, loader_drain_steps(workers))
    sampler = RandomSampler(workload.dataset, replacement=True, num_samples=(steps + warmup) * b)
    loader = DataLoader(workload.dataset, batch_size=b, sampler=sampler, num_workers=workers,
                        pin_memory=device.type == "cuda", prefetch_factor=LOADER_PREFETCH if workers else None)
    try:
        t0 = 0.0
        for i, (x, y) in enumerate(loader):
            if i == warmup:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            runner.step(*to_device(x, y))  # on a side stream, as `planner train` copies (planner.cli.steps.DeviceCopy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / steps
    finally:
        runner.close()


def _summary(e: Any, plan: Any, window: TimedWindow, *, timed: bool = True) -> dict[str, Any]:
    """One strategy's last epoch: throughput from the synchronized window (planner/cli/bench_window.py), per-rank times
    from the step timer (its step time stays beside it as ``steptimer_step_time_s``)."""
    timing = window.result(sum(e.batch_sizes))
    sps = timing["samples_per_s"]
    step_s = timing["seconds"] / timing["steps"]
    ranks = []
    for s, rp in zip(e.stats, plan.ranks, strict=True):
        ranks.append({
            "rank": s["rank"], "batch_size": s["batch_size"], "num_workers": s["num_workers"],
            "measured_step_time_s": s["step_time_s"], "measured_compute_s": s["compute_s"],
            "data_wait_s": s["data_wait_s"],
            "idle_fraction": max(0.0, 1.0 - (s["compute_s"] + s["data_wait_s"]) / s["step_time_s"])
            if s["step_time_s"] and timed else None,
            # the plan's one per-rank prediction (planner.solve.rank_step_s), as its table prints it
            "predicted_busy_s": rp.timer_busy_s, "predicted_loader_s": rp.predicted_loader_s,
        })
    return {
        "samples_per_s": sps, "step_time_s": step_s, "steptimer_step_time_s": e.step_time_s,
        "predicted_step_time_s": plan.predicted.step_time_s,
        # measured / predicted - 1, the one sign convention of every benchmark
        "predicted_error": (step_s / plan.predicted.step_time_s - 1.0) if plan.predicted.step_time_s else None,
        "window": timing, "setup": window.setup,
        "batch_sizes": list(e.batch_sizes), "ranks": ranks, "loss": e.loss,
        "accumulation_steps": [r.accumulation_steps for r in plan.ranks],
    }


def _label(opts: BenchOptions) -> str:
    parts = []
    if opts.emulate_slowdown:
        parts.append(f"emulated compute skew {opts.emulate_slowdown}")
    if opts.emulate_loader:
        parts.append(f"real loader skew (workers capped {opts.emulate_loader})")
    if opts.emulate_memory:
        parts.append(f"emulated small memory {opts.emulate_memory} GiB (real out-of-memory errors)")
    if opts.mixed_devices:
        parts.append(f"real device mix {opts.rank_devices}")
    if opts.late_slowdown:
        parts.append(f"mid-run slowdown {opts.late_slowdown} (plan+replan)")
    return "; ".join(parts) or "homogeneous"


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    import platform

    return f"CPU {platform.machine()}"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def format_bench(result: dict[str, Any]) -> str:
    from planner.table import table

    rows = []
    for name in (*STRATEGIES, "ideal"):
        s = result.get(name)
        if not s:
            continue
        if "samples_per_s" not in s:
            rows.append((name, "-", "-", "-", "-", "-", s.get("infeasible", "not run")[:60], "-"))
            continue
        steps = s.get("accumulation_steps") or [1] * len(s.get("batch_sizes", []))
        rows.append((
            name, f"{s['samples_per_s']:.1f}",
            f"{1000 * s['step_time_s']:.2f}" if "step_time_s" in s else "-",
            f"{1000 * s['predicted_step_time_s']:.2f}" if "predicted_step_time_s" in s else "-",
            f"{s['vs_equal']:.2f}x" if s.get("vs_equal") else
            (f"{s['vs_equal_accum']:.2f}x eq-acc" if s.get("vs_equal_accum") else "-"),
            f"{s['vs_ideal']:.3f}" if s.get("vs_ideal") else "-",
            " ".join(str(b) if k == 1 else f"{b}/{k}" for b, k in zip(s.get("batch_sizes", []), steps, strict=False)),
            " ".join(f"{100 * r['idle_fraction']:.0f}%" for r in s.get("ranks", []) if r["idle_fraction"] is not None)
            or "-",
        ))
    m = result.get("meta", {})
    head = (f"{m.get('model')} on {', '.join(m.get('devices', []))}; global batch {m.get('global_batch')}; "
            f"{m.get('data')}; heterogeneity: {m.get('heterogeneity')}")
    body = table(["strategy", "samples/s", "step ms", "predicted ms", "vs equal", "vs ideal", "batches", "idle"], rows)
    return head + "\n" + body


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as `planner bench`")
