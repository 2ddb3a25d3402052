"""What does the own-loop form (runtime.PlannedRun) cost in epoch 0 against the stock DDP script?

docs/ADOPTING.md's "Re-planning in your own loop" moves a stock script (DistributedSampler + BatchSampler +
DataLoader + DDP) onto a plan: ``PlannedRun`` builds the sampler, ``register_weighted_hook`` weights the
gradient, ``run.watch`` closes each step's compute span on the first parameter's gradient, and ``run.epoch``
times every step and, when the loader is exhausted, runs the epoch end (three small all-gathers, the Replanner's
decision, the run log).  Epoch 0 runs the plan's split before any re-plan: with an equal plan it trains exactly
what the stock script trains, so any time it takes beyond the stock script's is the runtime's own cost.

This script launches both loops' equivalents under torchrun, in alternating pairs (stock, planned, stock,
planned, ...), and reports per pair the epoch-0 wall seconds (from the loop's start to its exit, the planned
epoch end included), the rank-0 process CPU seconds over the epoch (gloo's threads included), the median step
interval and the epoch's tail (last step's end to the loop's exit: the planned epoch end).  ``--variants`` adds
the pieces one at a time, to say where a difference comes from:

    stock     DistributedSampler + BatchSampler, DDP's built-in all-reduce
    sampler   HeteroBatchSampler over the plan instead (DDP's built-in all-reduce)
    hook      ... and the weighted comm hook (register_weighted_hook)
    timed     ... and PlannedRun's per-step timing (run.watch + run.timed), no epoch end
    planned   the documented form: run.epoch (timing and the epoch end)
    planned-warm  the same with scipy.optimize imported at set-up: the first epoch end's re-solve imports it
              (planner solves lazily, so `import planner` stays light), which is most of epoch 0's end

Each launch set writes ONE compact JSON record to docs/results/ (``--record-dir``), named
``cpux<ranks>_<model>_own-loop-cost_<nn>.json``: the command, the CPU, torch, per pair the epoch-0 seconds of
every variant, and the median ratio to stock with its min-max.

    .venv/bin/python benchmarks/own_loop_cost.py --model mlp --pairs 5
    .venv/bin/python benchmarks/own_loop_cost.py --model cnn --pairs 5 --variants stock,sampler,hook,timed,planned
    .venv/bin/python benchmarks/own_loop_cost.py --model tiny --pairs 7 --no-record   # the test script's MLP
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "sampler", "hook", "timed", "planned", "planned-warm")
MODELS = {
    # name: (samples, per-rank batch, what it is)
    "tiny": (100, 8, "tests/runtime/stock_ddp_script.py's MLP 8-16-1, 100 samples"),
    "mlp": (4096, 64, "MLP 512-512-512-10 (two hidden layers of width 512), 4096 samples"),
    "cnn": (2048, 64, "CNN conv16-conv32-fc10 on 3x32x32, 2048 samples"),
}


# -- one rank of one launch (under torchrun) ------------------------------------------------------------------------
def _data_and_model(name: str) -> tuple[Any, Any, str]:
    import torch
    from torch.utils.data import TensorDataset

    n = MODELS[name][0]
    g = torch.Generator().manual_seed(1234)  # same data on every rank
    torch.manual_seed(0)
    if name == "tiny":
        data = TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g))
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return data, net, "mse"
    if name == "mlp":
        data = TensorDataset(torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))
        net = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                  torch.nn.ReLU(), torch.nn.Linear(512, 10))
        return data, net, "ce"
    data = TensorDataset(torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 10))
    return data, net, "ce"


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    data, net, kind = _data_and_model(args.model)
    # --device cuda: every rank on cuda:0, over gloo (NCCL refuses two ranks on one GPU).
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model = DDP(net.to(device), device_ids=[0] if device.type == "cuda" else None)
    variant = args.worker
    batch = MODELS[args.model][1]
    run: Any = None
    if variant == "stock":
        sampler: Any = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
        loader = DataLoader(data, batch_sampler=BatchSampler(sampler, batch, drop_last=False),
                            num_workers=args.workers)
    else:
        from runtime import PlannedRun, register_weighted_hook
        from runtime.sampler import HeteroBatchSampler

        if variant in ("sampler", "hook"):
            sampler = HeteroBatchSampler.from_plan(args.plan, rank, len(data), seed=args.seed)
        else:
            run = PlannedRun(args.plan, profile=args.profile, replan=True, log_file=args.log_file, seed=args.seed)
            sampler = run.sampler_for(len(data), device)
        loader = DataLoader(data, batch_sampler=sampler, num_workers=args.workers)
        if variant != "sampler":
            register_weighted_hook(model, sampler)
        if run is not None:
            run.watch(model)
        if variant == "planned-warm":
            import scipy.optimize  # noqa: F401 -- what the first re-solve would import inside epoch 0's end
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_of(x: Any, y: Any) -> Any:
        out = model(x)
        return F.mse_loss(out, y) if kind == "mse" else F.cross_entropy(out, y)

    epochs: list[dict[str, float]] = []
    for epoch in range(args.epochs):
        last = epoch == args.epochs - 1
        if variant in ("planned", "planned-warm"):
            batches: Any = run.epoch(epoch, loader, last=last)
        elif variant == "timed":
            run.epoch_start(epoch)
            batches = run.timed(loader)
        else:
            sampler.set_epoch(epoch)
            batches = loader
        marks: list[float] = []
        prof = cProfile.Profile() if args.cprofile and rank == 0 and epoch == 0 else None
        if prof is not None:
            prof.enable()
        c0, t0 = time.process_time(), time.perf_counter()
        for x, y in batches:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = loss_of(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            marks.append(time.perf_counter())
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # both loops' queued work inside their epoch
        t1, c1 = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.disable()
            prof.dump_stats(args.cprofile)
        steps = [b - a for a, b in itertools.pairwise(marks)][2:]  # after two warm-up steps
        epochs.append({"wall_s": t1 - t0, "cpu_s": c1 - c0, "steps": len(marks),
                       "step_s": statistics.median(steps) if steps else float("nan"),
                       "tail_s": t1 - marks[-1] if marks else float("nan")})
    if run is not None and not run._finished:
        run.finish(args.epochs)
    from runtime.collectives import all_gather_json  # after training: the stock loop imports nothing of ours

    everyone = all_gather_json(epochs)
    dist.barrier()  # every rank's results are out before any rank tears gloo down
    dist.destroy_process_group()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"variant": variant, "ranks": everyone}))
    return 0


# -- the launcher ---------------------------------------------------------------------------------------------------
def _plan_and_profile(tmp: Path, ranks: int, batch: int, workers: int) -> tuple[Path, Path]:
    """An equal plan over ``ranks`` equally fast CPU ranks: epoch 0 trains what the stock script trains."""
    import planner

    compute = (planner.ComputePoint(batch_size=batch // 2, step_time_s=0.002),
               planner.ComputePoint(batch_size=batch, step_time_s=0.004))
    profile = planner.Profile(hosts=(planner.HostProfile(name="h", cpu_cores=os.cpu_count() or 1),),
                              ranks=tuple(planner.RankProfile(rank=i, host="h", device="cpu", compute=compute)
                                          for i in range(ranks)))
    plan = planner.evaluate(profile, [batch] * ranks, num_workers=[workers] * ranks)
    profile.save(tmp / "profile.json")
    plan.save(tmp / "plan.json")
    return tmp / "plan.json", tmp / "profile.json"


def _launch(args: argparse.Namespace, variant: str, tmp: Path, plan: Path, profile: Path, i: int) -> dict[str, Any]:
    out = tmp / f"{variant}_{i}.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(args.ranks), str(Path(__file__).resolve()),
           "--worker", variant, "--device", args.device, "--model", args.model, "--epochs", str(args.epochs), "--workers", str(args.workers),
           "--plan", str(plan), "--profile", str(profile), "--log-file", str(tmp / f"run_{i}.jsonl"),
           "--out", str(out)]
    if args.cprofile:
        Path(args.cprofile).mkdir(parents=True, exist_ok=True)
        cmd += ["--cprofile", str(Path(args.cprofile, f"{variant}_{i}.pstats").resolve())]
    env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
    if not out.exists():
        raise SystemExit(f"{variant} launch {i} wrote no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["rc"] = proc.returncode  # a launch that trained and then aborted in teardown still counts its epoch
    result["aborted"] = "terminate called" in proc.stderr
    return result


def _gpu_tag() -> str:
    """h200x1 for one NVIDIA H200 (the card's model, lower case, and the count)."""
    import torch

    name = torch.cuda.get_device_name(0).split()[-1].lower() if torch.cuda.is_available() else "gpu"
    return f"{name}x1"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _next_record(directory: Path, stem: str) -> Path:
    taken = [int(m.group(1)) for p in directory.glob(f"{stem}_*.json") if (m := re.fullmatch(rf"{stem}_(\d+)\.json",
                                                                                              p.name))]
    return directory / f"{stem}_{max(taken, default=0) + 1:02d}.json"


def _r(x: float, digits: int = 4) -> float:
    return round(float(x), digits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp")
    parser.add_argument("--pairs", type=int, default=5, help="rounds of alternating launches (>= 5 for a record)")
    parser.add_argument("--variants", default="stock,planned",
                        help=f"comma-separated, in launch order within a round, from {','.join(VARIANTS)}; "
                             "stock must be among them (the ratios' base)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks on this host")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where every rank trains: cpu, or cuda (all ranks on cuda:0, over gloo)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers per rank")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per launch (epoch 0 is reported; >= 2 makes "
                        "epoch 0 a re-planning epoch, as in a real run)")
    parser.add_argument("--record-dir", default=str(REPO / "docs" / "results"))
    parser.add_argument("--no-record", action="store_true", help="print the table only")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per launch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cprofile", metavar="DIR", help="write rank 0's epoch-0 cProfile of every launch to "
                        "DIR/<variant>_<round>.pstats (it slows the Python parts: not for the timing table)")
    # worker-side (torchrun runs this file again with --worker)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--log-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or "stock" not in variants:
        parser.error(f"--variants: {bad or 'stock is missing'} (choose from {', '.join(VARIANTS)})")
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    _, batch, what = MODELS[args.model]
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        plan, profile = _plan_and_profile(tmp, args.ranks, batch, args.workers)
        for i in range(args.pairs):
            this: dict[str, dict[str, Any]] = {}
            for v in variants:
                this[v] = _launch(args, v, tmp, plan, profile, i)
                e0 = this[v]["ranks"][0][0]
                print(f"pair {i} {v:8s} epoch 0 {e0['wall_s']:.3f} s  cpu {e0['cpu_s']:.3f} s  "
                      f"step {1e3 * e0['step_s']:.2f} ms  tail {1e3 * e0['tail_s']:.1f} ms"
                      + ("  (aborted in teardown)" if this[v]["aborted"] else ""), flush=True)
            rounds.append(this)

    def epoch0(r: dict[str, Any], key: str) -> float:
        return max(float(rank[0][key]) for rank in r["ranks"])  # the synchronous epoch: its slowest rank

    base = [epoch0(r["stock"], "wall_s") for r in rounds]
    summary: dict[str, Any] = {}
    print(f"\n{args.model} ({what}), {args.ranks} gloo ranks, batch {batch}/rank, {args.workers} workers, "
          f"{args.pairs} rounds; epoch 0, medians over rounds (ratio: per round, to that round's stock)")
    print("| variant | epoch 0 s | x stock (min-max) | rank-0 CPU s | step ms | step overhead us (% of step) | "
          "tail ms |")
    print("|---|---|---|---|---|---|---|")
    stock_step = statistics.median(float(r["stock"]["ranks"][0][0]["step_s"]) for r in rounds)
    for v in variants:
        walls = [epoch0(r[v], "wall_s") for r in rounds]
        ratios = [w / b for w, b in zip(walls, base, strict=True)]
        cpu = statistics.median(float(r[v]["ranks"][0][0]["cpu_s"]) for r in rounds)
        step = statistics.median(float(r[v]["ranks"][0][0]["step_s"]) for r in rounds)
        tail = statistics.median(epoch0(r[v], "tail_s") for r in rounds)
        extra = step - stock_step
        summary[v] = {"epoch0_s": [_r(w) for w in walls], "ratio_median": _r(statistics.median(ratios)),
                      "ratio_min": _r(min(ratios)), "ratio_max": _r(max(ratios)), "cpu0_s_median": _r(cpu),
                      "step_ms_median": _r(1e3 * step, 3), "tail_ms_median": _r(1e3 * tail, 2),
                      "aborted": sum(bool(r[v]["aborted"]) for r in rounds)}
        print(f"| {v} | {statistics.median(walls):.3f} | {statistics.median(ratios):.3f} "
              f"({min(ratios):.3f}-{max(ratios):.3f}) | {cpu:.3f} | {1e3 * step:.2f} | "
              f"{1e6 * extra:+.0f} ({100 * extra / stock_step:+.1f}%) | {1e3 * tail:.1f} |")
    if args.no_record:
        return 0
    import torch

    record = {
        "record": 1, "kind": "own-loop-cost", "source": "benchmarks/own_loop_cost.py",
        "command": "python benchmarks/own_loop_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__, "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "meta": {"model": args.model, "workload": what, "ranks": args.ranks, "batch_per_rank": batch,
                 "workers": args.workers, "epochs": args.epochs, "rounds": args.pairs,
                 "plan": "equal", "order": variants},
        "epoch0": summary,
    }
    directory = Path(args.record_dir)
    directory.mkdir(parents=True, exist_ok=True)
    cards = f"cpux{args.ranks}" if args.device == "cpu" else f"{_gpu_tag()}-sharedx{args.ranks}"
    path = _next_record(directory, f"{cards}_{args.model}_own-loop-cost")
    path.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"record: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
