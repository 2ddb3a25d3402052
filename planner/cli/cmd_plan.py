"""`planner plan`: solve per-rank batch sizes, shares and loader workers for a global batch."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from planner.argcheck import MAX_COUNT, count
from planner.comm_model import links_line
from planner.errors import ValidationError
from planner.launchenv import export_lines
from planner.options import BATCHNORM_MIN_BATCH, DEFAULT_MIN_GAIN, MODES, SolveOptions
from planner.paths import Output, check_outputs
from planner.plan import Plan
from planner.profile import Profile
from planner.quality import (
    ProfileQuality,
    check_profile,
    extrapolation_lines,
    keep_equal_within_noise,
    kept_within_noise,
    noise_line,
)
from planner.solve import (
    accumulation_note,
    build_models,
    evaluate,
    kept_equal_split,
    restrict_profile,
    solve,
    subset_line,
    with_subset,
)
from planner.table import table

HELP = "solve per-rank batch sizes, shares and workers for a global batch"
EPILOG = """\
examples:
  planner plan --profile profile.json --global-batch 512 --out plan.json
  planner plan --profile profile.json --global-batch 512 --min-batch 8      # at least 8 samples a rank
  planner plan --profile profile.json --global-batch 512 --from-batches 256,256   # evaluate a given split
  planner plan --profile profile.json --global-batch 4096 --mode fsdp     # same micro-steps on every rank
  planner plan --profile profile.json --global-batch 64 --max-micro-batch 8   # accumulate past 8 per forward
  eval "$(planner plan --profile profile.json --global-batch 512 --print-env)"   # the measured NCCL setting
  planner plan --profile profile.json --global-batch 256 --exclude-ranks 1   # plan without rank 1

The global batch is your convergence choice: the planner never changes it.  Where it exceeds what the ranks'
memory holds in one step, or where a fast rank is held back by its memory, ranks run gradient accumulation
(the table's "micro-batches" column: steps x largest micro-batch).  Where leaving a rank out is predicted
clearly faster (its share of the all-reduce costs more than its samples give), one line says so with the launch
that leaves it out (`--exclude-ranks`).  It prints a table for people and writes the
plan JSON (`--json` prints it to stdout instead) that `planner train --plan` and
`HeteroBatchSampler.from_plan` read.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", required=True, metavar="PATH", help="profile JSON from `planner profile`")
    p.add_argument("--global-batch", "--global_batch", type=count(), required=True, metavar="B",
                   help="samples per optimizer step summed over all ranks (kept exactly)")
    add_solve_arguments(p)
    p.add_argument("--from-batches", default=None, metavar="B0,B1,..",
                   help="skip the solver: evaluate this split (comma-separated, one per rank); a batch over a rank's "
                        "cap is refused")
    p.add_argument("--exclude-ranks", default=None, metavar="R0,R1,..",
                   help="plan without these ranks of the profile: the kept ranks are renumbered 0..k-1 in their "
                        "order (a line says how), so launch k ranks")
    p.add_argument("--force", action="store_true",
                   help="with --from-batches: write the plan even when a batch is over its rank's cap (a warning "
                        "says which rank will run out of memory)")
    p.add_argument("--out", default=None, metavar="PATH", help="write the plan JSON here (atomically)")
    p.add_argument("--json", action="store_true", help="print the plan JSON to stdout instead of the table")
    p.add_argument("--print-env", action="store_true",
                   help="print only the plan's launch setting as `export NAME=VALUE` lines (none when the profile "
                        "measured nothing better than NCCL's defaults), for `eval \"$(planner plan ... --print-env)\"` "
                        "before torchrun; `planner train --plan` applies it itself")


def add_solve_arguments(p: argparse.ArgumentParser, *, from_plan: bool = False) -> None:
    """The solver's options (``SolveOptions``), shared by `planner plan` and `planner report`: same names and units.

    With ``from_plan`` every default is None, meaning "the plan's own" (``solve_options_from_args``).
    """
    d = SolveOptions()

    def default(value: object, text: str) -> tuple[object, str]:
        return (None, "the plan's") if from_plan else (value, text)

    mb_text = "the plan's" if from_plan else f"{d.min_batch}, or 2 when the profile's model has BatchNorm"
    p.add_argument("--min-batch", "--min_batch", type=count(), default=None, metavar="M",
                   help=f"smallest local batch per rank (default {mb_text})")
    p.add_argument("--max-batch-per-rank", "--max_batch_per_rank", type=count(), default=None, metavar="N",
                   help="cap every rank's batch per optimizer step (all its micro-batches together) at N samples, on "
                        "top of its memory cap; accumulation never gets past it"
                        + (" (default: the plan's)" if from_plan else ""))
    p.add_argument("--max-micro-batch", "--max_micro_batch", type=count(), default=None, metavar="N",
                   help="cap what one forward+backward holds on every rank at N samples, on top of the memory cap "
                        "the profile measured (a CPU profile measures none): a rank whose share is larger runs "
                        "gradient accumulation" + (" (default: the plan's)" if from_plan else ""))
    v, text = default(d.memory_headroom, f"{d.memory_headroom}")
    p.add_argument("--memory-headroom", type=float, default=v, metavar="FRAC",
                   help=f"fraction of device memory kept free when capping the batch (default {text})")
    v, text = default(d.cpu_reserve_per_rank, f"{d.cpu_reserve_per_rank}")
    p.add_argument("--cpu-reserve-per-rank", type=count(0), default=v, metavar="CORES",
                   help=f"cores per rank kept for the training process, not for loader workers (default {text})")
    v, text = default(d.max_workers_per_rank, "none: the host's cores less --cpu-reserve-per-rank per rank, "
                                              "shared by its ranks, are the only bound")
    p.add_argument("--max-workers-per-rank", type=count(), default=v, metavar="W",
                   help=f"most loader workers given to one rank (default {text})")
    v, text = default(DEFAULT_MIN_GAIN, f"{DEFAULT_MIN_GAIN}; 0 = always the optimum")
    p.add_argument("--min-gain", type=float, default=v, metavar="FRAC",
                   help=f"keep the equal split unless the plan is predicted this much faster (default {text})")
    v, text = default(d.mode, d.mode)
    p.add_argument("--mode", choices=MODES, default=v,
                   help="gradient accumulation: ddp = each rank its own number of micro-steps (no_sync), fsdp = the "
                        f"same number on every rank (default {text})")
    v, text = default(d.max_accumulation_steps, f"{d.max_accumulation_steps}; 1 = never accumulate")
    p.add_argument("--max-accumulation-steps", type=int, default=v, metavar="K",
                   help=f"most micro-steps per optimizer step on one rank (default {text})")
    v, text = default(d.batch_multiple, f"{d.batch_multiple}: any batch")
    p.add_argument("--batch-multiple", type=count(), default=v, metavar="M",
                   help="every rank's batch and micro-batch a multiple of M, so a model compiled with static shapes "
                        "or captured in CUDA graphs runs few shapes (the global batch must be a multiple of M; a "
                        f"profile compiled with a dynamic batch dimension needs none; default {text})")


_SOLVE_FLAGS = ("min_batch", "max_batch_per_rank", "max_micro_batch", "memory_headroom", "cpu_reserve_per_rank", "max_workers_per_rank",
                "min_gain", "mode", "max_accumulation_steps", "batch_multiple")


def solve_options_from_args(args: argparse.Namespace, base: SolveOptions | None = None,
                            profile: Profile | None = None) -> SolveOptions:
    """``base`` (default ``SolveOptions()``) with every solver flag the user gave (None = not given) applied.

    ``--max-batch-per-rank`` is the one option whose None is a value ("no cap"): without a base it stays None.
    Without a base and without ``--min-batch``, a ``profile`` whose model has BatchNorm (``meta.has_batchnorm``)
    plans at least 2 samples a rank: BatchNorm cannot normalize one sample, and training refuses such a plan.
    """
    given = {k: getattr(args, k) for k in _SOLVE_FLAGS if getattr(args, k, None) is not None}
    if base is None and "min_batch" not in given and profile is not None and profile.meta.get("has_batchnorm"):
        given["min_batch"] = BATCHNORM_MIN_BATCH
    return (base or SolveOptions()).with_overrides(given)


def _parse_batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValidationError(f"--from-batches: expected comma-separated integers, got {text!r}") from None
    bad = [b for b in batches if not 1 <= b <= MAX_COUNT]
    if bad or not batches:
        raise ValidationError(f"--from-batches: every batch must be an integer in 1..{MAX_COUNT}, got "
                              f"{bad[0] if bad else 'nothing'}")
    return batches


def over_caps(profile: Profile, batches: list[int], options: SolveOptions) -> list[str]:
    """One phrase per rank whose given batch cannot fit: over --max-batch-per-rank, or over its memory cap even as
    ``max_accumulation_steps`` micro-batches (a batch over the memory cap alone is run in micro-batches)."""
    out = []
    k_max = options.max_accumulation_steps
    for m, b in zip(build_models(profile, options), batches, strict=True):
        if m.batch_cap is not None and b > m.batch_cap:
            out.append(f"rank {m.rank} gets {b} samples, over --max-batch-per-rank {m.batch_cap}")
        elif m.micro_cap is not None and -(-b // k_max) > m.micro_cap:
            split = "" if k_max == 1 else f" even in {k_max} micro-batches (--max-accumulation-steps)"
            why = ("--max-micro-batch" if m.micro_cap == options.max_micro_batch
                   else f"memory fit with {options.memory_headroom:.0%} headroom")
            out.append(f"rank {m.rank} gets {b} samples, over its memory cap of {m.micro_cap} ({why}){split}: it "
                       "would run out of memory")
    return out


def _evaluate_given(profile: Profile, args: argparse.Namespace, options: SolveOptions) -> tuple[Plan, list[str]]:
    """The plan for ``--from-batches``; a batch over its rank's cap is refused unless ``--force`` (then warned)."""
    batches = _parse_batches(args.from_batches)
    if sum(batches) != args.global_batch:
        raise ValidationError(f"--from-batches sums to {sum(batches)} but --global-batch is {args.global_batch}")
    if len(batches) != profile.world_size:
        raise ValidationError(f"--from-batches gives {len(batches)} batch sizes for a profile of "
                              f"{profile.world_size} ranks")
    over = over_caps(profile, batches, options)
    if over and not args.force:
        raise ValidationError(f"--from-batches: {'; '.join(over)} -- lower its batch, or pass --force to write the "
                              "plan anyway")
    warnings = [f"warning: --force: {o}" + ("" if o.endswith("memory") else ", which may run out of memory")
                for o in over]
    # One micro-step when accumulation is ruled out (a forced split then stays over its cap, as asked).
    steps = [1] * len(batches) if options.max_accumulation_steps == 1 else None
    return evaluate(profile, batches, accumulation_steps=steps, options=options), warnings


def run(args: argparse.Namespace) -> int:
    # Every output is checked before anything is solved (planner/paths.py): never an input, never a device.
    check_outputs([Output(flag="--out", path=args.out)], {"--profile": args.profile})
    if args.force and not args.from_batches:
        raise ValidationError("--force only applies to --from-batches (the solver never exceeds a cap)")
    profile = Profile.load(args.profile)
    renumbered = None
    if args.exclude_ranks is not None:
        keep = kept_ranks(args.exclude_ranks, profile.world_size)
        profile = restrict_profile(profile, keep)
        renumbered = ", ".join(f"{old} -> {new}" for new, old in enumerate(keep))
    options = solve_options_from_args(args, profile=profile)
    quality = check_profile(profile)
    warnings: list[str] = list(quality.warning_lines())  # printed after the work: never before an error line
    if args.from_batches:
        plan, given = _evaluate_given(profile, args, options)
        warnings += given
    else:
        def plan_for(p: Profile, q: ProfileQuality | None = None) -> Plan:
            out = solve(p, global_batch=args.global_batch, options=options)
            if options.min_gain > 0:  # --min-gain 0 asks for the optimum whatever the noise
                out = keep_equal_within_noise(p, out, q if q is not None else check_profile(p))
            return out

        plan = plan_for(profile, quality)
        if renumbered is None:  # a plan over kept ranks names no further ranks (its ids are renumbered)
            plan = with_subset(profile, plan, plan_for)
    plan = record_workload(plan, profile)
    warnings += extrapolation_lines(plan, profile)
    if args.out:
        plan.save(args.out)
    for w in dict.fromkeys(warnings):  # after the work: a warning never precedes an error line; each once
        print(w, file=sys.stderr)
    if args.print_env:
        for line in export_lines(plan.launch_env):
            print(line)
    elif args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print(format_plan(plan, profile, quality, command=_command(args)))
        if renumbered is not None:
            print(f"  ranks renumbered (profile rank -> plan rank): {renumbered}")
        if args.out:
            print(f"\nwrote {args.out}")
    return 0


def kept_ranks(text: str, world_size: int) -> list[int]:
    """The ranks ``--exclude-ranks`` keeps, in order; one line for an id that is not a rank or for leaving out
    every rank."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValidationError(f"--exclude-ranks: expected comma-separated rank ids, got {text!r}") from None
    bad = [r for r in out if not 0 <= r < world_size]
    if bad or not out:
        raise ValidationError(f"--exclude-ranks: rank {bad[0] if bad else 'nothing'} given, but the profile has ranks "
                              f"0..{world_size - 1}: give ids in that range")
    keep = [r for r in range(world_size) if r not in out]
    if not keep:
        raise ValidationError(f"--exclude-ranks {text} leaves out all {world_size} ranks of the profile: keep at "
                              "least one")
    return keep


def _command(args: argparse.Namespace) -> str:
    """The `planner plan` call a subset line extends (the profile and global batch as given)."""
    return f"planner plan --profile {args.profile} --global-batch {args.global_batch}"


def record_workload(plan: Plan, profile: Profile) -> Plan:
    """The plan with ``meta.workload``: the model and input shape its profile measured, so `planner train` can
    refuse to run it for another model (the meta is not part of the fingerprint)."""
    workload = {"model": profile.model.name if profile.model else None,
                "sample_shape": profile.meta.get("sample_shape")}
    workload = {k: v for k, v in workload.items() if v is not None}
    return replace(plan, meta={**plan.meta, "workload": workload}) if workload else plan


def cite_warnings(line: str, quality: ProfileQuality) -> str:
    """``line`` with each quality issue it quotes in full cut down to its subject: every command that prints the
    plan's summary prints the profile's warnings before it (`planner plan`, `planner train --auto`), so the
    finding is said once, and the summary points to it."""
    for issue in quality.issues:
        line = line.replace(f"({issue.subject}: {issue.what})", f"({issue.subject}: see its warning above)")
    return line


def format_plan(plan: Plan, profile: Profile | None = None, quality: ProfileQuality | None = None, *,
                command: str | None = None) -> str:
    """The plan as an aligned table plus the predicted throughput against equal split and ideal.  The quality
    issues behind a noise line are cited, not repeated (``cite_warnings``): the caller prints the warnings.
    ``command``: the `planner plan` call a line on leaving ranks out extends (``planner.solve.subset_line``)."""
    names = {r.rank: (r.device_name or r.device) for r in profile.by_rank} if profile else {}
    rows: list[tuple[object, ...]] = [
        (r.rank, names.get(r.rank, r.device), r.batch_size, f"{100 * r.share:.1f}%", r.num_workers,
         f"{1000 * r.timer_busy_s:.2f}", r.bottleneck)
        for r in plan.ranks
    ]
    headers = ["rank", "device", "batch", "share", "workers", "step ms", "bottleneck"]
    if plan.accumulates:  # steps x largest micro-batch, beside the per-step batch
        headers.insert(3, "micro-batches")
        rows = [(*row[:3], f"{r.accumulation_steps} x {r.micro_batch_size}", *row[3:])
                for row, r in zip(rows, plan.ranks, strict=True)]
    hosts = [r.host for r in plan.ranks]
    if len(set(hosts)) > 1:  # ranks on several hosts: which share one (their loader cores, their links)
        headers.insert(1, "host")
        rows = [(row[0], host, *row[1:]) for row, host in zip(rows, hosts, strict=True)]
    out = [table(headers, rows)]
    p = plan.predicted
    eq = p.equal_split_samples_per_s
    lines = [
        f"global batch {plan.global_batch} on {plan.world_size} rank(s)"
        + (f" ({plan.mode})" if plan.mode != "ddp" else "")
        + f"; predicted step {1000 * p.step_time_s:.2f} ms (comm {1000 * p.comm_s:.2f} ms)",
        f"  plan         {p.samples_per_s:12.1f} samples/s"
        + (f"   {p.samples_per_s / eq:.2f}x equal split" if eq > 0 else ""),
        "  equal split  " + (f"{eq:12.1f} samples/s" if eq > 0 else "  does not fit (a rank's memory cap is below B/W)"),
        f"  ideal        {p.ideal_samples_per_s:12.1f} samples/s   plan = {p.samples_per_s / p.ideal_samples_per_s:.3f} of ideal",
    ]
    note = accumulation_note(plan)
    if note is not None:
        lines.append(f"  {note}")
    links = links_line(plan.meta.get("allreduce"))
    if links is not None:
        lines.append(f"  {links}")
    if plan.launch_env:  # measured to help by the profile; `planner train` applies it, other launchers need it
        lines.append(f"  launch with {' '.join(f'{k}={v}' for k, v in sorted(plan.launch_env.items()))} (measured "
                     "faster than NCCL's default; `planner train` sets it, --print-env prints it for scripts)")
    noisy = noise_line(plan, quality) if quality is not None else None
    if noisy is not None and quality is not None:
        noisy = cite_warnings(noisy, quality)
    kept = kept_equal_split(plan)
    for_noise = kept_within_noise(plan)
    if noisy is not None:
        lines.append(f"  {noisy}")
    elif for_noise is not None:  # the profile's quality is not at hand here; the plan says why it kept the split
        optimum, gain, noise = for_noise
        lines.append(f"  kept the equal split: the optimum {optimum} is predicted {1.0 + gain:.2f}x as fast, inside "
                     f"the profile's own noise (measurements off by up to {noise:.0%}); --min-gain 0 plans it anyway")
    elif kept is not None:
        optimum, gain, min_gain = kept
        lines.append(f"  kept the equal split: the optimum {optimum} is predicted only {gain:.1%} faster "
                     f"(< min gain {min_gain:.0%}); --min-gain 0 plans it anyway")
    left_out = subset_line(plan, profile, command=command)
    if left_out is not None:
        lines.append(f"  {left_out}")
    out.append("\n".join(lines))
    return "\n\n".join(out)

