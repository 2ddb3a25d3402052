"""`planner profile`: measure step time, memory, loader cost and all-reduce on each rank; write one profile JSON.

Run alone it profiles one device (or several with ``--devices``); under torchrun every rank profiles its own device
(LOCAL_RANK -> cuda:LOCAL_RANK, or cpu) and rank 0 writes the file.  torch is imported only inside ``run``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from planner.argcheck import GPU_NORMALIZE_CHOICES, check_ranks, count, real
from planner.errors import ValidationError
from planner.paths import Output, check_outputs
from planner.profile import GRAD_COMPRESSIONS, Profile
from planner.table import table
from profiler.compiled import COMPILE_MODES
from profiler.sweep import parse_batch_sizes
from profiler.workloads.emulate import cap_device_memory, parse_rank_floats, parse_rank_gib, parse_rank_ints

HELP = "measure step time, memory, loader cost and all-reduce on each rank"
EPILOG = """\
examples:
  planner profile --model mlp --dataset fake --device cpu --quick --out profile.json
  planner profile --model resnet50 --dataset fake --amp --out profile.json            # cuda:0, bf16
  planner profile --model resnet18 --dataset fake --devices cuda:0,cpu --out mix.json   # two local devices
  torchrun --standalone --nproc-per-node 2 -m planner profile --model resnet50 --amp \\
      --emulate-slowdown 1=3 --out profile.json                                        # rank 1 runs 3x slower

Each rank's compute curve is the median wall time of full training steps (forward, backward, SGD step) at a
geometric sweep of local batch sizes on synthetic on-device inputs, until the memory limit, a step slower than
the limit, or the time budget.  The loader cost is the seconds one worker spends per sample of the real dataset
pipeline.  Under torchrun the gradient all-reduce (25 MiB buckets, like DDP) is timed on the job's backend.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet18", metavar="M",
                   help="torchvision classification name (resnet18, resnet50, ..), mnist_cnn, cifar_cnn, mlp, or "
                        "package.module:factory (default resnet18)")
    p.add_argument("--dataset", default="fake", metavar="D",
                   help="fake, cifar10:DIR, mnist:DIR, imagefolder:DIR or package.module:factory (default fake)")
    p.add_argument("--image-size", type=count(), default=None, metavar="PX",
                   help="input side in pixels (default: 224 for torchvision models, 32 cifar_cnn, 28 mnist_cnn/mlp)")
    p.add_argument("--num-classes", type=count(), default=None, metavar="N", help="classifier outputs (default from data)")
    p.add_argument("--device", default="auto", metavar="DEV",
                   help="auto (cuda:LOCAL_RANK if a GPU is visible, else cpu), cpu or cuda:N")
    p.add_argument("--devices", default=None, metavar="LIST",
                   help="profile several local devices in turn in this process, e.g. cuda:0,cuda:1,cpu (one rank each)")
    p.add_argument("--batch-sizes", default="auto", metavar="auto|B,..",
                   help="local batch sizes to time (default auto: 8,16,32,.. until memory, step limit or budget)")
    p.add_argument("--max-batch", type=count(), default=None, metavar="B", help="largest batch of the auto sweep")
    p.add_argument("--budget-s", type=real(0.0, lo_open=True), default=None, metavar="SEC",
                   help="seconds of compute sweep per device (default 30; 6 with --quick)")
    p.add_argument("--quick", action="store_true", help="CI-sized run: fewer repeats, small budget (seconds per device)")
    p.add_argument("--thorough", action="store_true",
                   help="a slower, fuller profile: every sweep point's full repeats, the sweep growing "
                        "to its budget, step limit or memory even once linear, the loader after the sweep (to compare)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast for forward and loss (as in training with --amp)")
    p.add_argument("--compile", nargs="?", const="default", default=None, choices=COMPILE_MODES, metavar="MODE",
                   help="time the step compiled: torch.compile(model, mode=MODE) (default mode: default; "
                        f"{', '.join(COMPILE_MODES)}), the batch dimension marked dynamic; each rank's "
                        "meta.compile records the compile and recompile seconds")
    p.add_argument("--compile-backend", default="inductor", metavar="NAME",
                   help="torch.compile backend with --compile (default inductor; aot_eager/eager: capture only)")
    p.add_argument("--channels-last", choices=("auto", "on", "off"), default="auto",
                   help="channels_last memory format for image models (auto: on for CUDA)")
    p.add_argument("--no-loader", action="store_true", help="skip the dataloader measurement")
    p.add_argument("--gpu-normalize", nargs="?", const="on", default="auto", choices=GPU_NORMALIZE_CHOICES,
                   help="built-in image datasets: measure the loader handing over uint8 images that the GPU "
                        "normalizes, as `planner train` runs it (auto, the default: on when every device profiled "
                        "is CUDA; off: the workers normalize)")
    p.add_argument("--emulate-slowdown", default=None, metavar="R=F,..",
                   help="emulate slower ranks: rank R runs F x its real compute (e.g. 1=3,2=1.5)")
    p.add_argument("--emulate-memory", default=None, metavar="R=GIB,..",
                   help="emulate a smaller GPU: rank R may allocate only GIB GiB (real out-of-memory errors), e.g. 0=20")
    p.add_argument("--emulate-loader", default=None, metavar="R=W,..",
                   help="cap rank R's loader at W workers (recorded; the trainer applies it)")
    p.add_argument("--grad-compress", choices=GRAD_COMPRESSIONS, default="none",
                   help="send the gradients of the measured DDP steps in this format, as `planner train "
                        "--grad-compress` will (the plan's prediction then includes it; default none)")
    p.add_argument("--out", default="profile.json", metavar="PATH", help="profile JSON to write (default profile.json)")
    p.add_argument("--pg-timeout-s", type=real(0.0, lo_open=True), default=900.0, metavar="SEC",
                   help="torch.distributed timeout under torchrun (default 900: ranks wait for the slowest profile)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (quality warnings and the result still print)")


def run(args: argparse.Namespace) -> int:
    slowdowns = parse_rank_floats(args.emulate_slowdown, flag="--emulate-slowdown")
    loader_caps = parse_rank_ints(args.emulate_loader, flag="--emulate-loader")
    memory_caps = parse_rank_gib(args.emulate_memory)
    batch_sizes = parse_batch_sizes(args.batch_sizes)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.devices and distributed:
        raise ValidationError("--devices profiles local devices in one process; under torchrun use --device per rank")
    # Everything a user typed is checked before a single step is measured (on every rank under torchrun): a bad
    # --out found after the sweep would lose the whole measurement.
    check_outputs([Output(flag="--out", path=args.out)])
    if args.devices:
        world = len([d for d in args.devices.split(",") if d.strip()])
    else:
        world = int(os.environ["WORLD_SIZE"]) if distributed else 1
    check_ranks(slowdowns, world, "--emulate-slowdown")
    check_ranks(loader_caps, world, "--emulate-loader")
    check_ranks(memory_caps, world, "--emulate-memory")

    import torch

    from planner.cli.distenv import resolve_device
    from planner.cli.progress import Progress
    from planner.quality import check_profile
    from profiler import run as prun
    from profiler.compiled import compile_options
    from profiler.sweep import SweepOptions
    from profiler.workloads.specs import build_workload, gpu_normalize_for

    if args.devices:
        kinds = [resolve_device(d.strip(), 0, flag=f"--devices {args.devices}").type
                 for d in args.devices.split(",") if d.strip()]
    else:  # this rank's device, as `planner train` resolves it
        kinds = [resolve_device(args.device, int(os.environ.get("LOCAL_RANK", "0"))).type]
    workload = build_workload(args.model, args.dataset, image_size=args.image_size, num_classes=args.num_classes,
                              gpu_normalize=gpu_normalize_for(args.gpu_normalize, args.model, args.dataset, kinds))
    overrides: dict[str, Any] = {}
    if args.max_batch is not None:
        overrides["max_batch"] = args.max_batch
    if args.budget_s is not None:
        overrides["total_budget_s"] = args.budget_s
    if args.thorough:
        overrides.update(linear_stop_tol=None, spread_stop=None)
    sweep = SweepOptions.quick(**overrides) if args.quick else SweepOptions(**overrides)
    channels_last = {"auto": None, "on": True, "off": False}[args.channels_last]
    # The command line, when we were started as `planner profile ...` (not when called in-process).
    command = "planner " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["profile"] else None
    meta = {"command": command,
            "quick": bool(args.quick),
            "compile": args.compile,
            "thorough": bool(args.thorough) or None,
            "emulate_slowdown": {str(k): v for k, v in slowdowns.items()} or None,
            "emulate_loader": {str(k): v for k, v in loader_caps.items()} or None,
            "emulate_memory_gib": {str(k): v for k, v in memory_caps.items()} or None}
    meta = {k: v for k, v in meta.items() if v is not None}
    common: dict[str, Any] = dict(quick=args.quick, batch_sizes=batch_sizes, amp=args.amp,
                                  channels_last=channels_last, measure_loader=not args.no_loader, sweep=sweep,
                                  overlap_loader=False if args.thorough else None,
                                  # Every rank runs the same pipeline: one measurement per host serves all of
                                  # them, each keeping its own --emulate-loader cap (the same flag on every rank).
                                  loader_per_host=not args.thorough,
                                  compile=compile_options(args.compile, args.compile_backend))

    # Rank 0 only (under torchrun): one line per phase and point, a heartbeat while a phase runs long.
    rank = int(os.environ.get("RANK", "0"))
    with Progress("profile", enabled=not args.quiet and rank == 0) as progress:
        common["progress"] = progress
        if args.devices:
            devices = [d.strip() for d in args.devices.split(",") if d.strip()]
            for d in devices:
                # A clear error for a device this machine lacks, naming the flag typed, before anything is measured.
                resolve_device(d, 0, flag=f"--devices {args.devices}")
            for i, d in enumerate(devices):
                cap_device_memory(torch.device(d), memory_caps.get(i))
            profile: Profile | None = prun.profile_devices(workload, devices, slowdowns=slowdowns,
                                                           loader_caps=loader_caps, meta=meta, **common)
        elif distributed:
            profile = _run_distributed(args, workload, slowdowns, loader_caps, meta, common, torch, prun)
        else:
            device = str(resolve_device(args.device, 0))
            cap_device_memory(torch.device(device), memory_caps.get(0))
            rp = prun.profile_this_rank(workload, device, slowdown=slowdowns.get(0, 1.0),
                                        loader_workers_cap=loader_caps.get(0), **common)
            profile = prun.gather_profile(rp, workload=workload, meta=meta, grad_compress=args.grad_compress)
    if profile is not None:
        profile.save(args.out)
        print(format_profile(profile))
        print(f"\nwrote {args.out}")
        # A profile taken on a busy machine is valid but not trustworthy: say so now, with the numbers.
        for line in check_profile(profile).warning_lines():
            print(line, file=sys.stderr)
    return 0


def _run_distributed(args: argparse.Namespace, workload: Any, slowdowns: dict[int, float], loader_caps: dict[int, int],
                     meta: dict[str, Any], common: dict[str, Any], torch: Any, prun: Any) -> Profile | None:
    world = int(os.environ["WORLD_SIZE"])
    # gloo for the control traffic works for every mix of devices; gather_profile times NCCL when all are CUDA.
    from planner.cli.distenv import init_from_env, shutdown

    env = init_from_env(args.device, backend="gloo", timeout_s=args.pg_timeout_s)
    cap_device_memory(env.device, parse_rank_gib(args.emulate_memory).get(env.rank))
    try:
        _, on_host, _ = prun.host_layout()
        if env.device.type == "cpu":
            # CPU ranks sharing a host split its cores, as they will in training.
            from profiler.loader import usable_cores

            torch.set_num_threads(max(1, usable_cores() // on_host))
        rp = prun.profile_this_rank(workload, str(env.device), slowdown=slowdowns.get(env.rank, 1.0),
                                    loader_workers_cap=loader_caps.get(env.rank), **common)
        return prun.gather_profile(rp, workload=workload, meta={**meta, "world_size": world},  # type: ignore[no-any-return]
                                   progress=common["progress"], grad_compress=args.grad_compress)
    finally:
        shutdown(env)


def format_profile(profile: Profile) -> str:
    """Per-rank summary table plus model and all-reduce lines."""
    rows = []
    for r in profile.by_rank:
        pts = r.compute
        best = max(pts, key=lambda p: p.batch_size / p.step_time_s)
        cap = r.memory.max_batch_size if r.memory and r.memory.max_batch_size else "-"
        rows.append((
            r.rank, r.device, (r.device_name or "")[:28], len(pts), f"{pts[0].batch_size}-{pts[-1].batch_size}",
            f"{1000 * pts[0].step_time_s:.2f}", f"{1000 * pts[-1].step_time_s:.2f}",
            f"{best.batch_size / best.step_time_s:.0f}", cap,
            f"{1e3 * r.loader.sec_per_sample:.3f}" if r.loader else "-",
            f"{r.meta.get('emulate_slowdown', 1.0):g}x",
        ))
    out = [table(["rank", "device", "name", "pts", "batches", "first ms", "last ms", "best samples/s", "max batch",
                  "loader ms/sample", "emul"], rows)]
    hosts = ", ".join(f"{h.name} ({h.cpu_cores} cores)" for h in profile.hosts)
    lines = [f"hosts: {hosts}"]
    for r in profile.by_rank:
        c = r.meta.get("compile")
        if isinstance(c, dict) and isinstance(c.get("sizes"), list):
            lines.append(f"rank {r.rank} compiled ({c.get('mode')}, {c.get('backend')}, batch dimension "
                         f"{'dynamic' if c.get('dynamic') == 'batch' else 'static'}): first step +{_secs(c.get('first_s'))} "
                         f"(the compile); {c.get('recompiles')} graph(s) recompiled over {len(c['sizes'])} sizes"
                         + (f", at {c.get('recompiled_sizes')}, up to +{_secs(c.get('recompile_s'))}"
                            if c.get("recompiled_sizes") else ""))
    if profile.model:
        lines.append(f"model: {profile.model.name}, {profile.model.num_params or 0:,} params, "
                     f"{(profile.model.grad_bytes or 0) / 2**20:.1f} MiB of gradient")
    if profile.comm and profile.comm.allreduce_s is not None:
        lines.append(f"all-reduce ({profile.comm.backend}): {1000 * profile.comm.allreduce_s:.2f} ms per step")
        if profile.comm.exposed_s is not None:
            rounds = profile.meta.get("ddp_overhead_rounds_s")
            shown = (f" (median of {len(rounds)} rounds: {', '.join(f'{1000 * x:.2f}' for x in rounds)} ms)"
                     if isinstance(rounds, list) and len(rounds) > 1 else "")
            lines.append(f"DDP overhead per step, measured (all-reduce tail + DDP's own work): "
                         f"{1000 * profile.comm.exposed_s:.2f} ms{shown}")
        if profile.comm.span_tail_s is not None and profile.comm.span_factors is not None:
            lines.append("span factors by rank (span under DDP over alone) and the tail after the slowest span "
                         "(the plan's exposed communication): "
                         + ", ".join(f"{f:.3f}" for f in profile.comm.span_factors)
                         + f"; {1000 * profile.comm.span_tail_s:.2f} ms")
        if profile.comm.wait_factors is not None:
            # planner.comm_model: a rank's compute under DDP at a balanced split over alone, relative to the
            # least-waiting rank.
            lines.append("wait factors by rank (compute under DDP over alone, relative to the least-waiting rank): "
                         + ", ".join(f"{f:.3f}" for f in profile.comm.wait_factors))
        if profile.comm.launch_env:
            lines.append("launch setting measured faster than NCCL's default (recorded; `planner train` applies it): "
                         + " ".join(f"{k}={v}" for k, v in sorted(profile.comm.launch_env.items())))
    return "\n".join([*out, "", *lines])


def _secs(v: Any) -> str:
    return f"{v:.1f} s" if isinstance(v, (int, float)) else "? s"
