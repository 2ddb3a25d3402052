"""`planner train`: the reference trainer (runs alone or under torchrun; every rank runs the same command)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any

from planner.argcheck import ALLOW_RESUME_FLAG, GPU_NORMALIZE_CHOICES, MAX_IMAGE_SIZE, count, real
from planner.cli.advanced import add_help_all
from planner.options import BATCHNORM_MIN_BATCH
from planner.profile import GRAD_COMPRESSIONS

HELP = "train with a plan under torchrun (reference trainer)"
AUTO_PLAN_OUT = "plan.json"
AUTO_WRITER = "planner train --auto"
"""``plan.meta["written_by"]`` of plans `train --auto` writes: the only plan files it will overwrite unasked."""
DESCRIPTION = (
    "Train a torchvision model (FakeData by default) with per-rank batch sizes from a plan, exact weighted "
    "gradients and optional re-planning between epochs. Run it under torchrun; NCCL when every rank has its own "
    "GPU, gloo otherwise (mixed CPU + GPU ranks, or ranks sharing a GPU)."
)
EPILOG = """\
examples:
  torchrun --nproc-per-node 2 -m planner train --plan plan.json --epochs 2 --log-file run.jsonl
  torchrun --nproc-per-node 2 -m planner train --auto --global-batch 512 --replan --model resnet50 --amp
  torchrun --nproc-per-node 2 -m planner train --plan plan.json --rank-devices cuda:0,cpu   # mixed, gloo
  torchrun --nproc-per-node 2 -m planner train --auto --global-batch 64 --device cpu --quick \\
      --emulate-slowdown 1=3 --replan --epochs 4        # one machine, rank 1 emulated 3x slower

--help-all also lists the advanced options: emulated heterogeneity (--emulate-*), the loader check's length,
the re-plan threshold, and the switches kept to measure variants (--weighting, --data-on-device, ...).
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    adv = add_help_all(p)
    g = p.add_argument_group("plan")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--plan", metavar="PATH", help="plan JSON from `planner plan` (same file on every rank)")
    src.add_argument("--auto", action="store_true", help="profile every rank in-process, solve, write the plan")
    g.add_argument("--global-batch", type=count(), default=None, metavar="B",
                   help="samples per step over all ranks (required with --auto; must match --plan)")
    g.add_argument("--min-batch", type=count(), default=1, metavar="M", help="--auto: smallest local batch (default 1)")
    g.add_argument("--quick", action="store_true", help="--auto: a short profile (CI-sized)")
    g.add_argument("--max-workers-per-rank", type=count(), default=None, metavar="W",
                   help="--auto: most loader workers the plan gives one rank (default: no cap of its own; the "
                        "host's cores less one per rank bound them all)")
    g.add_argument("--plan-out", default=None, metavar="PATH",
                   help=f"--auto: where rank 0 writes the plan (default {AUTO_PLAN_OUT}, which is only replaced if an "
                        "earlier --auto wrote it; name it here to overwrite any file)")
    g.add_argument("--profile-out", default=None, metavar="PATH", help="--auto: also write the profile here")
    g.add_argument("--profile", default=None, metavar="PATH",
                   help="profile the plan came from (needed by --replan with --plan)")
    g.add_argument("--replan", action=argparse.BooleanOptionalAction, default=False,
                   help="re-plan between epochs from measured step times (default off)")
    g.add_argument("--allow-workload-mismatch", action="store_true",
                   help="train even when the plan or profile was made for another model or input size")
    w = p.add_argument_group("workload")
    # Defaults of None: "not given", so --resume can tell a value typed from the checkpoint's (planner/cli/preflight.py).
    w.add_argument("--model", default=None, metavar="M",
                   help="torchvision name (resnet50, ...), mnist_cnn, cifar_cnn, mlp, or package.module:factory "
                        "(default mlp; on --resume the checkpoint's built-in name -- a package.module:factory is typed again, "
                        "a checkpoint never chooses code)")
    w.add_argument("--dataset", default=None, metavar="D",
                   help="fake, cifar10:DIR, mnist:DIR, imagefolder:DIR or package.module:factory (default fake; on "
                        "--resume as --model)")
    w.add_argument("--image-size", type=count(1, MAX_IMAGE_SIZE), default=None, metavar="PX",
                   help=f"input side for fake data (at most {MAX_IMAGE_SIZE})")
    w.add_argument("--num-samples", type=count(), default=None, metavar="N", help="fake dataset length")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=count(), default=2, metavar="N", help="epochs (default 2)")
    t.add_argument("--lr", type=real(0.0, lo_open=True), default=None,
                   help="SGD learning rate (default 0.01, momentum 0.9; on --resume the checkpoint's). A loss that "
                        "diverges stops the run (exit 2) and keeps the last finite checkpoint")
    t.add_argument("--amp", action="store_true", help="bf16 autocast")
    t.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 (fully_shard per block) instead of DDP; the plan's per-rank "
                        "micro-batches run the same number of micro-steps on every rank (plan with --mode fsdp)")
    t.add_argument("--seed", type=count(0, 2**62), default=None,
                   help="shuffle and init seed, the same on every rank (default 0; on --resume the checkpoint's)")
    t.add_argument("--device", default="auto", metavar="DEV", help="auto, cpu, cuda or cuda:N for every rank")
    t.add_argument("--rank-devices", default=None, metavar="LIST",
                   help="one device per rank, e.g. cuda:0,cpu (mixed ranks use gloo)")
    t.add_argument("--log-file", "--log", dest="log", default=None, metavar="PATH",
                   help="JSON-lines run log (rank 0), read by `planner report`; under torchrun spell it --log-file "
                        "(torchrun takes --log for an abbreviation of its own --log-dir)")
    t.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="save an atomic checkpoint here each epoch (a folder already holding one needs --resume)")
    t.add_argument("--checkpoint-every", type=count(0), default=0, metavar="STEPS",
                   help="also checkpoint every STEPS steps inside an epoch (default 0: epoch ends only)")
    t.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint DIR when it holds one; values not given are the checkpoint's, "
                        "values given must match it")
    t.add_argument(ALLOW_RESUME_FLAG, action="store_true",
                   help="--resume with another --lr, --plan (same global batch), --seed or dataset than the "
                        "checkpoint's run (each change is printed)")
    t.add_argument("--quiet", action="store_true", help="no progress lines (epoch summaries still print)")
    t.add_argument("--step-log", default=None, metavar="FILE",
                   help="each epoch, append one JSON line per rank with every step's data wait, compute, step "
                        "interval and its batch's build seconds (warm-up included): the raw series behind the run "
                        "log's per-rank means, e.g. to find stalls; {rank} in FILE becomes the rank, else the ranks "
                        "append to one file")
    # Hidden: every (epoch, step, rank, indices) as JSON lines, for the resume tests; {rank} becomes the rank.
    t.add_argument("--trace-file", default=None, help=argparse.SUPPRESS)
    a = adv.group("advanced", "Settings with defaults that suit a run, and switches kept to measure variants.")
    a.add_argument("--replan-threshold", type=real(0.0, 1.0, hi_open=True), default=0.05, metavar="FRAC",
                   help="adopt a new plan only if it is predicted this much faster (default 0.05); with --auto, the "
                        "loader check moves the split only for this gain too")
    a.add_argument("--loader-check-s", type=real(0.0, 600.0), default=None, metavar="S",
                   help="--auto: seconds every rank runs its plan's DataLoader at once, before training, to scale the "
                        "profile's loader costs to what they measured and solve again (default 3, 1 with --quick; "
                        "0: no check)")
    a.add_argument("--gpu-normalize", nargs="?", const="on", default="auto", choices=GPU_NORMALIZE_CHOICES,
                   help="built-in image datasets: the workers hand over uint8 images and the GPU normalizes them, a "
                        "quarter of the bytes through shared memory, the pin copy and PCIe (auto, the default: on "
                        "when every rank trains on CUDA; off: the workers normalize; profile with the same choice)")
    a.add_argument("--weighting", choices=("loss-scale", "hook"), default="loss-scale",
                   help="exact weighting of uneven batches: scale the loss (default; DDP's own all-reduce, also exact "
                        "with SyncBatchNorm) or a Python comm hook (register_weighted_hook); the same parameters "
                        "either way")
    a.add_argument("--grad-compress", choices=GRAD_COMPRESSIONS, default="none",
                   help="all-reduce gradients in bf16 or fp16, half the bytes (opt-in: changes numerics to the "
                        "wire dtype's rounding). The plan's weighting scales each bucket by n_i / n in fp32 before "
                        "the cast (through the weighting hook), so uneven batches neither overflow nor underflow; "
                        "default none")
    a.add_argument("--data-on-device", action="store_true",
                   help="synthetic inputs made on the device, no DataLoader (isolates compute skew; --auto then "
                        "profiles no loader)")
    a.add_argument("--max-steps-per-epoch", type=count(), default=None, metavar="N",
                   help="cut each epoch after N steps (benchmarks; the epoch then misses samples)")
    a.add_argument("--restart-loader-each-epoch", action="store_true",
                   help="start the DataLoader afresh each epoch, as `for batch in loader` does; by default its "
                        "workers run on into the next epoch while the plan holds, so an epoch after the first does "
                        "not start by waiting for its first batch")
    e = adv.group("emulated heterogeneity", "Make identical devices unequal, to try the planner on one machine.")
    e.add_argument("--emulate-slowdown", default=None, metavar="R=F,..",
                   help="rank R does F x its real compute (repeated fwd+bwd), e.g. 1=3")
    e.add_argument("--emulate-slowdown-from-epoch", type=count(0), default=0, metavar="E",
                   help="start the emulated slowdown at epoch E (a mid-run slowdown)")
    e.add_argument("--emulate-loader", default=None, metavar="R=W,..", help="cap rank R's loader workers at W")
    e.add_argument("--emulate-memory", default=None, metavar="R=GIB,..",
                   help="emulate a smaller GPU: rank R may allocate only GIB GiB (real out-of-memory errors)")


def run(args: argparse.Namespace) -> int:
    from planner.argcheck import check_global_batch
    from planner.cli.autoplan import AutoPlanOptions, auto_plan
    from planner.cli.distenv import init_from_env, shutdown
    from planner.cli.preflight import preflight
    from planner.cli.progress import Progress
    from planner.cli.train import train
    from planner.errors import ValidationError
    from planner.profile import Profile
    from profiler.workloads.emulate import cap_device_memory, parse_rank_floats, parse_rank_gib, parse_rank_ints
    from profiler.workloads.specs import build_workload

    # Every path, number, rank map and the resume's consistency, on every rank, before the process group starts
    # (numbers were already range-checked while parsing).
    if not args.auto and args.max_workers_per_rank is not None:
        raise ValidationError("--max-workers-per-rank applies to --auto, which solves the plan; with --plan the plan's "
                              "workers are used: re-plan with `planner plan --max-workers-per-rank W`")
    if not args.auto and args.loader_check_s is not None:
        raise ValidationError("--loader-check-s applies to --auto, which solves the plan; with --plan the plan is used "
                              "as it is")
    pre = preflight(args)
    plan_out = None
    if args.auto:
        # --plan-out given: preflight checked it; the default plan.json is refused when a hand-made plan holds it.
        plan_out = auto_plan_out(args.plan_out)
        if args.plan_out is None:
            from planner.paths import Output, check_outputs

            check_outputs([Output(flag="--plan-out", path=plan_out)], {"--profile": args.profile})
    slowdowns = parse_rank_floats(args.emulate_slowdown)
    loader_caps = parse_rank_ints(args.emulate_loader)
    memory_caps = parse_rank_gib(args.emulate_memory)
    profile = Profile.load(args.profile) if args.profile else None
    if pre.plan is not None and args.replan and profile is None:
        raise ValidationError("--replan with --plan needs --profile PATH (the profile the plan came from)")
    if pre.plan is not None:  # NCCL reads its environment when the process group's communicator is made
        apply_launch_env(pre.plan.launch_env)
    env = init_from_env(args.device, args.rank_devices)
    cap_device_memory(env.device, memory_caps.get(env.rank))
    finished = False
    try:
        from planner.cli.train_resume import agree_on_resume

        # The first collective: every rank resumes the same checkpoint, or none does (node-local folders).
        agree_on_resume(args.checkpoint, pre.resume_at, pre.checkpoint_fingerprint)
        cfg = config_from_args(args, env, slowdowns, loader_caps, resume_changes=pre.changes)
        workload = build_workload(cfg.model, cfg.dataset, image_size=cfg.image_size, num_samples=cfg.num_samples,
                                  gpu_normalize=cfg.gpu_normalize)
        if env.is_main:
            for note in pre.notes:
                print(note, flush=True)
        with Progress("train", enabled=env.is_main and not args.quiet) as progress:
            if args.auto:
                if workload.has_batchnorm:  # the plan will ask for BatchNorm's floor: known before any profile
                    check_global_batch(args.global_batch, env.world_size, max(args.min_batch, BATCHNORM_MIN_BATCH),
                                       why=f" (a BatchNorm model needs {BATCHNORM_MIN_BATCH} per rank)")
                auto = auto_plan(cfg, env, workload, AutoPlanOptions(
                    global_batch=args.global_batch, min_batch=args.min_batch, quick=args.quick,
                    max_workers_per_rank=args.max_workers_per_rank, plan_out=plan_out, profile_out=args.profile_out,
                    written_by=AUTO_WRITER), progress=progress)
                plan, profile = auto.plan, auto.profile
                if env.is_main:
                    from planner.cli.cmd_plan import format_plan

                    print(format_plan(plan, profile, auto.quality, command=(
                        f"planner plan --profile {args.profile_out or 'PROFILE'} --global-batch {args.global_batch}")),
                        flush=True)
                    print(f"wrote the plan to {plan_out}" + ("" if args.plan_out else " (--plan-out PATH to choose)"),
                          flush=True)
            else:
                assert pre.plan is not None
                plan = pre.plan
                if not args.allow_workload_mismatch:
                    check_workload(plan, profile, model=cfg.model, sample_shape=workload.sample_shape)
                if env.is_main and profile is not None and not cfg.data_on_device:
                    line = normalize_mismatch(profile, uint8=workload.normalize is not None)
                    if line:
                        print(line, file=sys.stderr, flush=True)
            train(cfg, env, plan, profile, workload, progress=progress)
        finished = True
    finally:
        # After an error the peers may already be gone: tearing gloo down then can abort this process
        # (SIGABRT) after it printed its clear error, so the group is only destroyed on success.
        if finished:
            shutdown(env)
    return 0


def apply_launch_env(launch_env: Mapping[str, str]) -> None:
    """Set the plan's measured launch setting (Plan.launch_env) in this process's environment, before the
    process group starts; a variable the user set already is kept, and said so.  Only the allowed NCCL
    variables are ever set (planner.launchenv): the plan checked them at load, and they are checked again here."""
    from planner.launchenv import check_launch_env

    for name, value in sorted(check_launch_env(launch_env, "plan.launch_env").items()):
        have = os.environ.get(name)
        if have is None:
            os.environ[name] = value
        elif have != value:
            print(f"note: the plan's {name}={value} is not applied: {name}={have} is set in the environment",
                  file=sys.stderr, flush=True)


def auto_plan_out(plan_out: str | None) -> str:
    """Where `--auto` writes its plan: --plan-out when given; else plan.json, unless that file holds a plan
    `--auto` did not write (one made by hand with `planner plan`), which is refused rather than overwritten."""
    import os

    from planner.errors import ValidationError
    from planner.jsonio import read_json

    if plan_out is not None:
        return plan_out
    if os.path.exists(AUTO_PLAN_OUT):
        try:  # the bounded loader: a FIFO or a huge file in its place is refused, never waited on or read whole
            writer = (read_json(AUTO_PLAN_OUT, "plan").get("meta") or {}).get("written_by")
        except (ValueError, AttributeError):  # ValidationError is a ValueError: not a plan --auto wrote
            writer = None
        if writer != AUTO_WRITER:
            raise ValidationError(
                f"--auto would overwrite {AUTO_PLAN_OUT}, which `planner train --auto` did not write; pass "
                f"--plan-out PATH for the new plan (--plan-out {AUTO_PLAN_OUT} to replace it)"
            )
    return AUTO_PLAN_OUT


def check_workload(plan: Any, profile: Any, *, model: str, sample_shape: tuple[int, ...]) -> None:
    """Refuse a plan or profile measured for another model or input size, or a plan solved from another
    profile: its batch sizes would balance the wrong step times (``--allow-workload-mismatch`` skips this)."""
    from planner.errors import ValidationError

    fix = "re-profile and re-plan for this workload, or pass --allow-workload-mismatch"
    shape = "x".join(map(str, sample_shape))
    sources = [("the plan", dict(plan.meta.get("workload") or {}))]
    if profile is not None:
        sources.append(("the profile", {"model": profile.model.name if profile.model else None,
                                        "sample_shape": profile.meta.get("sample_shape")}))
        made_from = plan.made_for.get("profile_fingerprint") or plan.solver.get("profile_fingerprint")
        if made_from and made_from != profile.fingerprint():
            raise ValidationError(f"the plan was solved from another profile (fingerprint {made_from}, --profile "
                                  f"has {profile.fingerprint()}); re-plan from this profile, or pass "
                                  "--allow-workload-mismatch")
    for what, w in sources:
        if w.get("model") is not None and w["model"] != model:
            raise ValidationError(f"{what} was measured for --model {w['model']} but this run trains --model "
                                  f"{model}; {fix}")
        got = w.get("sample_shape")
        if isinstance(got, list) and tuple(got) != tuple(sample_shape):
            raise ValidationError(f"{what} was measured for inputs {'x'.join(map(str, got))} but this run feeds "
                                  f"{shape} (--image-size); {fix}")


def normalize_mismatch(profile: Any, *, uint8: bool) -> str | None:
    """A warning when the profile's loader handed over other images than this run's (``--gpu-normalize``): uint8
    images skip the workers' float conversion and normalization, so the loader costs it measured are not this run's."""
    if not profile.has_loader or bool(profile.meta.get("gpu_normalize")) == uint8:
        return None
    said = {True: "uint8 images (--gpu-normalize on)", False: "float images (--gpu-normalize off)"}
    return (f"warning: the profile timed the loader handing over {said[not uint8]}, this run hands over "
            f"{said[uint8]}: its loader costs are not this run's; profile again with the same --gpu-normalize")


def config_from_args(args: argparse.Namespace, env: Any, slowdowns: dict[int, float],
                     loader_caps: dict[int, int], resume_changes: tuple[str, ...] = ()) -> Any:
    """This rank's TrainConfig from the command line (the config checks itself on construction)."""
    from planner.cli.preflight import DEFAULTS
    from planner.cli.train import TrainConfig
    from profiler.workloads.specs import gpu_normalize_for

    late = args.emulate_slowdown_from_epoch > 0
    mixed = env.device.type == "cuda" and env.backend == "gloo" and not env.shared_gpu  # CPU ranks beside CUDA ones
    return TrainConfig(
        model=args.model, dataset=args.dataset, image_size=args.image_size, num_samples=args.num_samples,
        epochs=args.epochs, max_steps_per_epoch=args.max_steps_per_epoch, lr=args.lr, amp=args.amp,
        seed=args.seed, replan=args.replan, replan_threshold=args.replan_threshold,
        data_on_device=args.data_on_device,
        slowdown=1.0 if late else slowdowns.get(env.rank, 1.0), slowdown_late=slowdowns.get(env.rank, 1.0),
        slowdown_from_epoch=args.emulate_slowdown_from_epoch, loader_workers_cap=loader_caps.get(env.rank),
        log_path=args.log, checkpoint_dir=args.checkpoint, checkpoint_every=args.checkpoint_every,
        resume=args.resume, resume_changes=resume_changes, weighting=args.weighting.replace("-", "_"),
        grad_compress=args.grad_compress,
        trace_path=args.trace_file.replace("{rank}", str(env.rank)) if args.trace_file else None,
        restart_loader_each_epoch=args.restart_loader_each_epoch, loader_check_s=args.loader_check_s,
        gpu_normalize=gpu_normalize_for(args.gpu_normalize, args.model or DEFAULTS["model"],
                                        args.dataset or DEFAULTS["dataset"], ["cpu" if mixed else env.device.type]),
        step_log_path=args.step_log.replace("{rank}", str(env.rank)) if args.step_log else None,
        mixed_devices=mixed,
    )
