"""What `planner train` checks on every rank before the process group starts: nothing a user typed may fail
after an epoch of training, or destroy work.

- outputs (planner/paths.py): ``--log-file``, ``--step-log``, ``--trace-file`` writable regular files,
  ``--checkpoint`` a folder; never an input (``--log-file`` = the plan appended the run log into the plan);
- per-rank settings for ranks the job has (``--emulate-slowdown 5=3`` on one rank), an ``--auto`` global batch
  that can give every rank its min batch (it failed only after profiling);
- a fresh run never writes into work it did not make: a ``--log-file`` already holding a run log (the report
  merged the two runs) or a ``--checkpoint`` folder already holding a checkpoint (the first save replaced it)
  is refused -- ``--resume`` continues both;
- one run at a time per ``--checkpoint`` folder and ``--log-file``: the writing rank holds an exclusive lock on
  both for the run's life, taken on the output itself (planner.paths.hold_exclusive), and a second run is refused
  in one line; a killed save's temp files in the folder are removed once it is held;
- ``--resume`` compares this command line with what the checkpoint's run was started with (``run_meta``) and
  refuses a difference in one line naming both values: unchecked, the checkpoint's plan and learning rate would
  replace the ones given, silently, and another model would crash in ``load_state_dict``.  ``--allow-resume-changes``
  accepts a new ``--lr``, ``--plan`` (same global batch), seed or dataset; the model and the global batch must
  stay (the weights are that model's; the sampler's position is counted in steps of that global batch).

A value the user did not give (``--lr`` omitted) is the checkpoint's on ``--resume``, the documented default on a
fresh run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from planner.argcheck import ALLOW_RESUME_FLAG, ResumeValue, check_global_batch, check_ranks, check_resume
from planner.errors import ValidationError
from planner.paths import SHOWN_PATH, Output, check_not_written, check_outputs
from planner.plan import Plan

CHECKPOINT_FILE = "checkpoint.pt"  # planner.cli.checkpoint.CHECKPOINT_NAME, without importing torch here
CHECKPOINT_TEMP_PREFIX = ".checkpoint."  # planner.cli.checkpoint.TEMP_PREFIX
# Defaults of the values a resumed run takes from its checkpoint when they are not given.
DEFAULTS: dict[str, Any] = {"model": "mlp", "dataset": "fake", "seed": 0, "lr": 0.01}


@dataclass(kw_only=True, slots=True)
class Preflight:
    """What the checks found, for the rest of `planner train`."""

    plan: Plan | None = None
    """The --plan file, loaded (None with --auto)."""
    resuming: bool = False
    """--resume and the checkpoint folder holds a checkpoint: continue it (else a fresh run)."""
    saved_global_batch: int | None = None
    changes: tuple[str, ...] = ()
    """Values this run takes from its command line instead of the checkpoint ('lr', 'plan'), allowed by the flag."""
    notes: list[str] = field(default_factory=list)
    """Lines for rank 0 to print (accepted changes)."""
    resume_at: tuple[int, int] | None = None
    """(epoch, step) this rank resumes at; None: a fresh start."""
    checkpoint_fingerprint: str | None = None
    """Digest of the checkpoint file this rank resumes (planner.cli.checkpoint.checkpoint_fingerprint)."""


def run_meta(*, model: str, dataset: str, image_size: int | None, num_samples: int | None, seed: int, lr: float,
             plan: Plan) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it (``planner.cli.checkpoint.save_checkpoint(run=...)``)."""
    return {"model": model, "dataset": dataset, "image_size": image_size, "num_samples": num_samples, "seed": seed,
            "lr": lr, "global_batch": plan.global_batch, "world_size": plan.world_size,
            "plan_fingerprint": plan.fingerprint}


def _log_lines(path: str) -> int:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise ValidationError(f"--log-file {path}: cannot read it ({e.strerror})") from None


def check_outputs_and_ranks(args: argparse.Namespace, world_size: int, rank: int) -> None:
    """Output paths and per-rank maps (see the module docstring)."""
    trace = args.trace_file.replace("{rank}", str(rank)) if args.trace_file else None
    step_log = args.step_log.replace("{rank}", str(rank)) if args.step_log else None
    check_outputs(
        [Output(flag="--log-file", path=args.log), Output(flag="--checkpoint", path=args.checkpoint, folder=True,
                                                         files=(CHECKPOINT_FILE,)),
         Output(flag="--plan-out", path=args.plan_out if args.auto else None),
         Output(flag="--profile-out", path=args.profile_out if args.auto else None),
         Output(flag="--trace-file", path=trace), Output(flag="--step-log", path=step_log)],
        {"--plan": args.plan, "--profile": args.profile})
    from profiler.workloads.emulate import parse_rank_floats, parse_rank_gib, parse_rank_ints

    check_ranks(parse_rank_floats(args.emulate_slowdown), world_size, "--emulate-slowdown")
    check_ranks(parse_rank_ints(args.emulate_loader), world_size, "--emulate-loader")
    check_ranks(parse_rank_gib(getattr(args, "emulate_memory", None)), world_size, "--emulate-memory")


def check_workers_fit(plan: Plan, rank: int, cores: int | None = None) -> None:
    """Refuse a plan that gives this rank more loader workers than its host has cores.

    The solver never does (a host's workers share its cores, less a reserve per rank); a plan that does was
    made for other hosts or edited, and each worker is a forked process: 2,147,483,647 of them on a 2-core host
    is a fork bomb.
    """
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if rank < plan.world_size and plan.ranks[rank].num_workers > cores:
        raise ValidationError(f"the plan gives rank {rank} {plan.ranks[rank].num_workers} loader workers but this "
                              f"host has {cores} CPU cores; re-plan from a profile of this cluster")


def _saved_meta(state: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's run values; older checkpoints (no "run") still tell the lr and the global batch."""
    meta = dict(state.get("run") or {})
    groups = state["optimizer"].get("param_groups") or [{}]
    meta.setdefault("lr", groups[0].get("lr"))
    plan = Plan.from_dict(state["plan"])
    meta.setdefault("global_batch", plan.global_batch)
    meta.setdefault("world_size", plan.world_size)
    return meta


def _saved_value(key: str, value: Any, checkpoint_dir: str) -> Any:
    """A value the checkpoint's run record supplies for a flag the user left off.

    A ``--model``/``--dataset`` spec that names code (``package.module:factory``) is refused: a checkpoint is data,
    and data never chooses the code a command imports.  The user types the spec; the record is only compared with
    it (``compare_with_checkpoint``).
    """
    flag = f"--{key.replace('_', '-')}"
    expected = {"model": str, "dataset": str, "seed": int, "lr": float}[key]
    if isinstance(value, bool) or not isinstance(value, (int, float) if expected is float else expected):
        raise ValidationError(f"--resume: the checkpoint in {checkpoint_dir} records {flag} as "
                              f"{type(value).__name__} {str(value)[:40]!r}, not a {expected.__name__}; give {flag} "
                              "yourself, or start afresh in another --checkpoint folder")
    if key in ("model", "dataset"):
        from profiler.workloads.specs import DATASET_KINDS, names_code

        if names_code(str(value), flag):
            raise ValidationError(f"--resume: the checkpoint in {checkpoint_dir} was trained with {flag} {value!r}, "
                                  f"which names code to import; a checkpoint never chooses code -- pass {flag} "
                                  "yourself to resume it")
        # A data folder is typed too: a checkpoint's "imagefolder:/" would walk the whole filesystem.
        folders = {kind.partition(":")[0] for kind in DATASET_KINDS if kind.endswith(":DIR")}
        if key == "dataset" and str(value).partition(":")[0] in folders:
            raise ValidationError(f"--resume: the checkpoint in {checkpoint_dir} was trained with {flag} "
                                  f"{str(value)[:SHOWN_PATH]!r}, which names a data folder; a checkpoint never chooses the "
                                  f"files a run reads -- pass {flag} yourself to resume it")
    return value


def compare_with_checkpoint(args: argparse.Namespace, meta: dict[str, Any], plan: Plan | None) -> tuple[list[str], list[str]]:
    """(changes accepted, notes) for a resume; raises ValidationError for a refused difference."""
    B = meta.get("global_batch")
    given_B = plan.global_batch if plan is not None else args.global_batch
    values = {
        "model": ResumeValue(flag="--model", saved=meta.get("model"), given=args.model, changeable=False,
                    why=f"the checkpoint holds that model's weights -- resume with --model {meta.get('model')}, or "
                        "start afresh in another --checkpoint folder"),
        "global_batch": ResumeValue(flag="--global-batch", saved=B, given=given_B, changeable=False,
                    why=f"a resumed run keeps the global batch -- re-plan with --global-batch {B} (the position in "
                        "the epoch is counted in steps of it)"),
        "lr": ResumeValue(flag="--lr", saved=meta.get("lr"), given=args.lr),
        "seed": ResumeValue(flag="--seed", saved=meta.get("seed"), given=args.seed),
        "dataset": ResumeValue(flag="--dataset", saved=meta.get("dataset"), given=args.dataset),
        "num_samples": ResumeValue(flag="--num-samples", saved=meta.get("num_samples"), given=args.num_samples),
        "image_size": ResumeValue(flag="--image-size", saved=meta.get("image_size"), given=args.image_size),
    }
    same_world = plan is not None and meta.get("world_size") == plan.world_size
    if same_world and plan is not None and meta.get("plan_fingerprint"):
        # Another world size is an elastic restart (its own documented path); the same one with another plan is
        # a change: unchecked, the checkpoint's plan would win silently.
        values["plan"] = ResumeValue(flag=f"--plan {args.plan}: fingerprint", saved=meta["plan_fingerprint"],
                                     given=plan.fingerprint, fix="pass the plan file the run started with")
    notes = check_resume(values.values(), allow=args.allow_resume_changes)
    # Reaching here, every difference was allowed; the trainer applies these two over the checkpoint's state.
    return [key for key in ("lr", "plan") if key in values and values[key].differs], notes


def check_weights_fit(mine: Mapping[str, Any], saved: Mapping[str, Any], checkpoint_dir: str | None) -> None:
    """Refuse, in one line, a checkpoint holding another model's weights (``load_state_dict`` raised a multi-line
    RuntimeError); the checkpoint's model name is compared up front, this catches what a name cannot (an old
    checkpoint without one, a factory whose architecture changed)."""
    missing = [k for k in mine if k not in saved]
    extra = [k for k in saved if k not in mine]
    shapes = [k for k in mine if k in saved and tuple(saved[k].shape) != tuple(mine[k].shape)]
    if not (missing or extra or shapes):
        return
    if shapes:
        k = shapes[0]
        what = f"{k} is {list(saved[k].shape)} there and {list(mine[k].shape)} here"
    elif extra:
        what = f"its {extra[0]} has no counterpart here"
    else:
        what = f"it lacks this model's {missing[0]}"
    raise ValidationError(f"--resume: the checkpoint in {checkpoint_dir} holds another model's weights ({what}); "
                          "resume with the model it was trained with, or start afresh in another --checkpoint folder")


def preflight(args: argparse.Namespace) -> Preflight:
    """Every check of the module docstring, on this rank, before any process group, profile or step.

    Fills in the values the user did not give (the checkpoint's on a resume, else the defaults).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.resume and not args.checkpoint:
        raise ValidationError("--resume needs --checkpoint DIR (the folder the interrupted run saved to)")
    if args.allow_resume_changes and not args.resume:
        raise ValidationError(f"{ALLOW_RESUME_FLAG} only applies to --resume")
    check_outputs_and_ranks(args, world, rank)
    if rank == 0:  # the writing rank: one run at a time per checkpoint folder and run log, before any check of them
        from planner.paths import hold_exclusive

        if args.checkpoint:  # and the temp files of a save that was killed (kill -9 mid-save) go
            hold_exclusive(args.checkpoint, "--checkpoint", folder=True, stale_prefix=CHECKPOINT_TEMP_PREFIX)
        if args.log:
            hold_exclusive(args.log, "--log-file")
    out = Preflight()
    if args.plan:
        out.plan = Plan.load(args.plan)
        if out.plan.world_size == world:  # another world size is refused with its own line, or re-planned
            check_workers_fit(out.plan, rank)
        if args.global_batch is not None and args.global_batch != out.plan.global_batch:
            raise ValidationError(
                f"--global-batch {args.global_batch} differs from the plan's {out.plan.global_batch}; re-plan")
    state = None
    if args.checkpoint:
        # Read (and check: data only, docs/SECURITY.md) the checkpoint before anything is profiled or trained.
        import torch

        from planner.cli.checkpoint import load_checkpoint

        state = load_checkpoint(args.checkpoint, torch.device("cpu"))
    if state is not None and not args.resume:
        raise ValidationError(
            f"--checkpoint {args.checkpoint} already holds a checkpoint (epoch {state['epoch']} step {state['step']}); "
            "pass --resume to continue it, or name another folder (a fresh run would replace it)")
    out.resuming = state is not None
    if out.resuming:
        assert state is not None
        from planner.cli.checkpoint import checkpoint_fingerprint

        out.resume_at = (int(state["epoch"]), int(state["step"]))
        if world > 1:  # compared across ranks (planner.cli.train_resume.agree_on_resume); one rank reads its own
            out.checkpoint_fingerprint = checkpoint_fingerprint(args.checkpoint)
        meta = _saved_meta(state)
        out.saved_global_batch = meta["global_batch"]
        changes, out.notes = compare_with_checkpoint(args, meta, out.plan)
        out.changes = tuple(changes)
        for key in DEFAULTS:  # not given: the checkpoint's (data only: never a spec that names code)
            if getattr(args, key) is None and meta.get(key) is not None:
                setattr(args, key, _saved_value(key, meta[key], args.checkpoint))
        for key in ("image_size", "num_samples"):
            if getattr(args, key) is None and meta.get(key) is not None:
                setattr(args, key, meta[key])
        if args.auto and args.global_batch is None:  # elastic --auto: the interrupted run's global batch
            args.global_batch = out.saved_global_batch
    else:
        n = _log_lines(args.log) if args.log else 0
        if n:
            raise ValidationError(
                f"--log-file {args.log} already holds {n} line(s) of another run; a fresh run starts its own log -- "
                "name another file or remove it (--resume continues a run and its log)")
        # Before any process group: ranks sharing one step log all see it as it was before this run.
        check_not_written(args.step_log.replace("{rank}", str(rank)) if args.step_log else None, "--step-log")
    for key, value in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.auto:
        if args.global_batch is None:
            raise ValidationError("--auto needs --global-batch B (the global batch is your convergence choice)")
        check_global_batch(args.global_batch, world, args.min_batch)
    return out


__all__ = ["DEFAULTS", "Preflight", "check_weights_fit", "check_workers_fit", "compare_with_checkpoint", "preflight", "run_meta"]
