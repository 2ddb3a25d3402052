"""Checks that must pass before the first training collective, so a misconfigured run fails loudly, not hangs.

Ranks launched with different plans, datasets or seeds would build different sampler layouts: their batch counts
differ and some rank eventually waits in an all-reduce that never comes. One JSON all-gather up front
(``runtime.collectives.all_gather_json``: data, never pickle) compares what every rank must agree on and raises the same clear error on every rank.
Every such payload starts with the package version and the agreement format (:func:`gather_agreement`), compared
first: ranks running other code fail with one line naming both versions.

A planned sampler runs such a check itself (:func:`check_first_pass`, at its first pass, before its first batch),
so a script that adopts a plan by hand fails at its first step with one line on every rank, instead of training
silently wrong and dying later, for the three mistakes that are easy to make:

- ranks launched with different plans (or datasets, seeds, sampler options, epochs): their step counts differ;
- a DataLoader that cuts other batches than the plan's (``DataLoader(batch_size=32, sampler=
  HeteroDistributedSampler(...))``): each rank's step count then depends on its share, and the ranks fall apart;
- an uneven plan with nothing weighting the gradient: DDP's average counts every rank's mean loss alike.

Collectives run only on the main thread of the training process (never in a DataLoader worker or another thread),
only under an initialized process group, and at the same point on every rank (the sampler's first pass, which
every rank starts in the same order of its program).  Whether the gradient is weighted is known only once the first
loss is scaled, so that check is local and runs later: at the first backward through the DDP model
(:func:`arm_weighting_check`), before any gradient is all-reduced.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils.data import dataloader, get_worker_info

from planner.errors import ValidationError
from planner.options import BATCHNORM_MIN_BATCH
from planner.shown import shown_apart
from runtime.collectives import all_gather_json

if TYPE_CHECKING:
    from runtime.sampler import HeteroBatchSampler

AGREEMENT_FORMAT = 2
"""Layout of every agreement payload (the fields below, ``settings`` a dict by flag). Each payload starts with
this and the package version, and those two are compared before any other field: ranks running other code fail
with one line naming both versions instead of a KeyError on a field the other version does not send."""
VERSION_FIX = "install the same ddp-planner version on every host (pip install ddp-planner==VERSION), then relaunch"

# Field name in the message -> the fix to print with it.
_FIXES = {
    "world size": "launch every rank with the same --nproc-per-node/--nnodes and a plan for that many ranks",
    "plan fingerprint": "launch every rank with the same --plan file",
    "dataset length": "every rank must see the same dataset (same files, split and filters)",
    "seed": "pass the same --seed to every rank",
}


def check_agreement(*, plan_fingerprint: str, dataset_len: int, seed: int, world_size: int | None = None,
                    settings: Mapping[str, Any] | None = None, group: Any = None) -> None:
    """All-gather (world size, plan fingerprint, dataset length, seed) and raise on any disagreement.

    Call it as the first collective of a run, after ``init_process_group`` and before DDP's constructor (which
    already broadcasts). Every rank raises the same ``ValidationError`` naming the field, the ranks and their
    values, e.g. "ranks disagree on plan fingerprint: rank 0 has 9f1c.., rank 1 has 03ab..; launch every rank
    with the same --plan file".

    Args:
        plan_fingerprint: ``plan.fingerprint`` of the plan this rank loaded.
        dataset_len: ``len(dataset)`` on this rank.
        seed: the sampler seed on this rank.
        world_size: the world size this rank expects (e.g. ``plan.world_size``); default: the group's size.
        settings: further values every rank must share, by the flag that sets them (``{"--lr": 0.01, "--epochs":
            10, ...}``): JSON-able.  Ranks with another learning rate train drifting replicas silently; another
            epoch count leaves a rank waiting in an all-reduce its peers never start.  Every rank must pass the
            same keys.
        group: process group (default: the default group).
    """
    actual = dist.get_world_size(group)
    mine = {
        "world size": actual if world_size is None else int(world_size),
        "plan fingerprint": str(plan_fingerprint),
        "dataset length": int(dataset_len),
        "seed": int(seed),
        "settings": dict(sorted((settings or {}).items())),
    }
    by_rank = gather_agreement(mine, group)
    _raise_on_disagreement(by_rank, _FIXES, width=10)
    names = sorted({k for r in by_rank for k in by_rank[r]["settings"]})
    settings_of = {r: {name: by_rank[r]["settings"].get(name) for name in names} for r in by_rank}
    _raise_on_disagreement(settings_of, {name: f"launch every rank with the same {name}" for name in names}, width=10)
    if mine["world size"] != actual:  # everyone agrees, but not with the group they are in
        raise ValidationError(
            f"every rank expects world size {mine['world size']} but the process group has {actual} ranks; "
            f"{_FIXES['world size']}"
        )


def gather_agreement(facts: Mapping[str, Any], group: Any = None) -> dict[int, dict[str, Any]]:
    """Every rank's ``facts`` by rank (collective: one JSON all-gather), after checking that every rank runs the
    same package version and agreement format -- the first two fields of every payload.

    The one mechanism behind every agreement (:func:`check_agreement`, :func:`check_settings`, the sampler's
    first pass, `planner train`'s resume check): a rank of another version raises the same one line on every rank,
    e.g. "ranks run different ddp-planner versions: rank 0 has 0.3.0 (agreement format 2), rank 1 has 0.2.1
    (agreement format 1); install the same ...", never a KeyError on a field one version lacks.
    """
    import planner

    mine = {"version": planner.__version__, "format": AGREEMENT_FORMAT, **facts}
    with _collective_device() if group is None and _initialized() else contextlib.nullcontext():
        gathered = all_gather_json(mine, group)
    by_rank = dict(enumerate(gathered))

    def said(payload: Any) -> str:
        if not isinstance(payload, dict) or "version" not in payload:
            return "an older version (its agreement names none)"
        return f"{_shown(payload.get('version'), 20)} (agreement format {_shown(payload.get('format'), 10)})"

    versions = {r: said(by_rank[r]) for r in by_rank}
    firsts = first_ranks(versions)
    if len(firsts) > 1:
        listed = ", ".join(f"rank {r} has {versions[r]}" for r in firsts[:3])
        first = by_rank[0].get("version") if isinstance(by_rank[0], dict) else None  # the same line on every rank
        raise ValidationError(f"ranks run different ddp-planner versions: {listed}; "
                              f"{VERSION_FIX.replace('VERSION', _shown(first or planner.__version__, 20))}")
    return by_rank


def first_ranks(values: Mapping[int, Any]) -> list[int]:
    """The first rank holding each distinct value (compared as JSON), in rank order: ``[0]`` when every rank
    agrees; the ranks an error line names when they do not."""
    firsts: dict[str, int] = {}
    for r in sorted(values):
        firsts.setdefault(json.dumps(values[r], sort_keys=True), r)
    return list(firsts.values())


def check_settings(settings: Mapping[str, Any], *, fixes: Mapping[str, str] | None = None, group: Any = None) -> None:
    """All-gather ``settings`` (JSON-able values by the flag that sets them) and raise on the first one, in the
    caller's order, that differs by rank: one line naming the setting and each rank's value, the same on every
    rank (collective).  ``fixes``: the fix to print for a setting (default "launch every rank with the same
    FLAG").  For what must agree before any plan exists (`planner train --auto`'s profiling options)."""
    by_rank = gather_agreement({"settings": [[str(k), v] for k, v in settings.items()]}, group)
    names: list[str] = []
    for r in sorted(by_rank):
        names += [str(k) for k, _ in by_rank[r].get("settings") or [] if str(k) not in names]
    values = {r: dict((str(k), v) for k, v in by_rank[r].get("settings") or []) for r in by_rank}
    settings_of = {r: {name: values[r].get(name) for name in names} for r in by_rank}
    fixes = fixes or {}
    _raise_on_disagreement(settings_of, {name: fixes.get(name, f"launch every rank with the same {name}")
                                         for name in names}, width=24)


def check_batchnorm(model: torch.nn.Module, min_batch: int) -> int:
    """The min_batch to use for ``model``: at least ``BATCHNORM_MIN_BATCH`` (2) when it has (non-synchronized)
    BatchNorm layers.

    BatchNorm in training mode raises on a batch of one sample ("Expected more than 1 value per channel") and is
    noisy on tiny ones; the sampler never yields a batch below the returned value. SyncBatchNorm normalizes over
    all ranks' samples, so it needs no per-rank minimum.
    """
    plain = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)]
    if not plain or min_batch >= BATCHNORM_MIN_BATCH:
        return min_batch
    warnings.warn(
        f"model has BatchNorm layers ({plain[0]}{' and more' if len(plain) > 1 else ''}): using "
        f"min_batch={BATCHNORM_MIN_BATCH} instead of {min_batch}, since a per-rank batch of 1 breaks BatchNorm; "
        "consider torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) so small per-rank batches normalize over all "
        "ranks",
        stacklevel=2,
    )
    return BATCHNORM_MIN_BATCH


# -- a planned sampler's own checks: its first pass, and whether the gradient is weighted -----------------------------

_WEIGHTING: set[str] = set()
"""How this process weights its gradients for an uneven plan ('hook', 'loss_scale', 'micro_steps', 'step_weights',
'PlannedRun', or what ``HeteroBatchSampler.declare_weighting`` was told): any entry satisfies the check."""


@dataclass(slots=True)
class _Watch:
    """The armed weighting check: a global forward pre-hook waiting for the first training forward."""

    message: str
    pid: int
    handle: Any


_watch: _Watch | None = None


def note_weighting(how: str) -> None:
    """Record that this process weights its gradients (``how``: the form). Every weighting form calls it --
    ``register_weighted_hook``, ``loss_scale``, ``accumulation_weight``, ``micro_steps``, ``step_weights``,
    ``PlannedRun`` -- so it is cheap: a set lookup once the form is known."""
    if how not in _WEIGHTING:
        _WEIGHTING.add(how)
        _disarm()


_TRAINING_THREADS: set[int] = set()
"""Threads other than the main one that run a training loop (``train_on_this_thread``)."""


def train_on_this_thread() -> None:
    """Count the calling thread as the training process's main thread: for a framework that runs the training
    function on a thread of its own (Ray Train's worker runs ``train_loop_per_worker`` on a "TrainingThread"), so
    the planned sampler's checks run there as they do on the main thread of an own script."""
    _TRAINING_THREADS.add(threading.get_ident())


def on_main_thread() -> bool:
    """True on the main thread of a training process, or on a thread that ``train_on_this_thread`` named (not a
    DataLoader worker, not another thread): the only place a planned sampler runs a collective, so its
    collectives keep the same order on every rank."""
    main = threading.current_thread() is threading.main_thread() or threading.get_ident() in _TRAINING_THREADS
    return main and get_worker_info() is None


def drawn_by_dataloader(depth: int = 8) -> bool:
    """True when a torch DataLoader iterator is among the ``depth`` callers: the pass is a training loop's (the
    DataLoader draws the sampler's batches, or its BatchSampler draws a HeteroDistributedSampler's indices).
    Code that iterates a sampler itself (``list(sampler)``, a layout computed for another rank) is not checked:
    it may run on one rank only, where a collective would wait forever."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), dataloader._BaseDataLoaderIter):
            return True
        frame = frame.f_back
    return False


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _nccl_device() -> int:
    """This rank's GPU for a JSON collective under NCCL: the device the process group is bound to, else the current
    one -- or ``LOCAL_RANK``'s when the script never called ``torch.cuda.set_device`` (current device 0 on every rank
    of a node, where NCCL refuses two ranks on one GPU)."""
    try:
        bound = dist.distributed_c10d._get_default_group().bound_device_id
    except (AttributeError, RuntimeError):
        bound = None
    if bound is not None:
        return int(bound.index or 0)
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK", "")
    if current == 0 and local.isdigit() and 0 < int(local) < torch.cuda.device_count():
        return int(local)
    return current


@contextlib.contextmanager
def _collective_device() -> Iterator[None]:
    if str(dist.get_backend()) == "nccl":
        with torch.cuda.device(_nccl_device()):
            yield
    else:
        yield


def _shown(value: Any, width: int = 40) -> str:
    text = str(value)
    return text[:width] + ".." if len(text) > width + 4 else text


def _raise_on_disagreement(by_rank: Mapping[int, Mapping[str, Any]], fixes: Mapping[str, str], *,
                           width: int = 40) -> None:
    """The first field of ``fixes`` (in its order) on which the gathered ranks differ: one ValidationError naming
    the field, the first rank of each distinct value (at most 3) with its value cut to ``width``, and the fix --
    the same line on every rank."""
    for field, fix in fixes.items():
        firsts: dict[str, int] = {}  # each distinct value (as JSON) -> the first rank holding it
        for r in sorted(by_rank):
            firsts.setdefault(json.dumps(by_rank[r][field], sort_keys=True), r)
        if len(firsts) > 1:
            ranks = list(firsts.values())[:3]
            texts = [_shown(by_rank[r][field], width) for r in ranks]
            if len(set(texts)) < len(texts):  # cut alike though they differ: show each where they differ
                texts = shown_apart([by_rank[r][field] for r in ranks], max(width, 24), text=str)
            listed = ", ".join(f"rank {r} has {t}" for r, t in zip(ranks, texts))
            raise ValidationError(f"ranks disagree on {field}: {listed}; {fix}")


# Layout facts every rank's sampler must share -> the fix to print with a disagreement.
_LAYOUT_FIXES = {
    "batch sizes": "launch every rank with the same plan file",
    "micro-steps": "launch every rank with the same plan file",
    "dataset length": _FIXES["dataset length"],
    "seed": "pass the same seed to every rank's sampler",
    "sampler options": "build every rank's sampler with the same shuffle, drop_last and min_batch",
    "epoch": "call sampler.set_epoch(epoch) with the same epoch on every rank",
    "start step": "resume every rank from the same checkpoint (sampler.load_state_dict)",
}


def equal_plan(sampler: HeteroBatchSampler) -> bool:
    """Every rank the same batch and the same micro-steps: then DDP's plain average is the exact gradient.

    With b_i = b and k_i = k on every rank, every rank holds the same number of samples in every step and
    micro-step -- the epoch's partial last step too (r_i = max(min_batch, ceil(R * b / B)) is one number, and an
    equal k gives every rank the same micro-batch count there) -- so n_i / n = 1 / W at every synchronization and
    DDP's (1 / W) * sum_i g_i is sum_i (n_i / n) g_i exactly: no weighting is needed.
    """
    return len(set(sampler.batch_sizes)) == 1 and len(set(sampler.accumulation_steps)) == 1


OWN_LOOP_WEIGHTING_FIX = ("call register_weighted_hook(model, sampler) after model = DDP(...), or multiply the loss by "
                          "runtime.loss_scale(sampler, step) (sampler.declare_weighting() if you weight it yourself)")
"""The fix the weighting check names for an own loop; an adapter's sampler names its own (``weighting_fix``)."""


def _weighting_message(sampler: HeteroBatchSampler) -> str:
    sizes, steps = list(sampler.batch_sizes), list(sampler.accumulation_steps)
    micro = f" in {steps} micro-steps" if max(steps) > 1 else ""
    fix = getattr(sampler, "weighting_fix", None) or OWN_LOOP_WEIGHTING_FIX
    return (f"the plan gives the ranks {_shown(sizes)} samples a step{micro}, but nothing weights the gradient by them "
            f"(DDP averages the ranks' gradients as if their batches were equal); {fix}")


def _loader_message(rank: int, cut: Any, planned: int) -> str:
    size, drop_last = cut
    how = f"batches of {size}" + (" with drop_last=True" if drop_last else "")
    return (f"rank {rank}'s DataLoader cuts {how} but the plan gives rank {rank} {planned} samples a step; build it as "
            "DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler) with drop_last=False (the default)")


def check_first_pass(sampler: HeteroBatchSampler, start_step: int, loader: tuple[int, bool] | None = None) -> None:
    """A planned sampler's check before its first batch: every rank raises the same one-line ValidationError when
    the ranks' samplers disagree or a DataLoader cuts other batches than the plan's.

    Under torch.distributed: ONE JSON all-gather (collective: the sampler calls it at its first pass, on the main
    thread, which every rank reaches in the same order) of the layout's facts (batch sizes and micro-steps,
    dataset length, seed, sampler options, epoch, start step), which plan rank each process took, how its
    DataLoader cuts batches and whether it weights the gradient already. Without a process group: the DataLoader's
    cut only.

    Args:
        sampler: the HeteroBatchSampler starting its first pass.
        start_step: the step the pass starts at (0, or the resumed one).
        loader: (batch_size, drop_last) of the DataLoader batching a ``HeteroDistributedSampler``; None when the
            sampler yields the batches itself (or the batching is not a torch BatchSampler).
    """
    planned = sampler.batch_sizes[sampler.rank]
    if not (dist.is_available() and dist.is_initialized()):
        if loader is not None and tuple(loader) != (planned, False):
            raise ValidationError(_loader_message(sampler.rank, loader, planned))
        return
    mine = {
        "batch sizes": list(sampler.batch_sizes), "micro-steps": list(sampler.accumulation_steps),
        "dataset length": sampler.dataset_len, "seed": sampler.seed,
        "sampler options": f"shuffle={sampler.shuffle}, drop_last={sampler.drop_last}, min_batch={sampler.min_batch}",
        "epoch": sampler.epoch, "start step": int(start_step),
        "plan rank": sampler.rank, "loader": None if loader is None else [int(loader[0]), bool(loader[1])],
        "weighted": bool(_WEIGHTING),
    }
    by_rank = gather_agreement(mine)
    _raise_on_disagreement(by_rank, _LAYOUT_FIXES)
    world, planned_world = len(by_rank), sampler.world_size
    if world % planned_world:
        raise ValidationError(
            f"the plan has batch sizes for {planned_world} ranks but {world} were launched; launch as many ranks as "
            f"the plan lists (plan.world_size) or re-plan for {world}")
    # Under data parallelism inside a larger job (tensor or pipeline parallel), world / planned_world processes
    # share each plan rank; plain DDP has one process per plan rank.
    takers: dict[int, list[int]] = {}
    for r in sorted(by_rank):
        takers.setdefault(int(by_rank[r]["plan rank"]), []).append(r)
    crowded = [(p, rs) for p, rs in sorted(takers.items()) if len(rs) != world // planned_world]
    if crowded:
        p, rs = max(crowded, key=lambda item: len(item[1]))
        raise ValidationError(
            f"ranks {', '.join(map(str, rs[:4]))} all built their sampler for plan rank {p} (of {planned_world}); "
            "pass rank=torch.distributed.get_rank() to the sampler")
    for r in sorted(by_rank):
        cut, own = by_rank[r]["loader"], sampler.batch_sizes[int(by_rank[r]["plan rank"])]
        if cut is not None and tuple(cut) != (own, False):
            raise ValidationError(_loader_message(r, cut, own))
    weighted = {r: by_rank[r]["weighted"] for r in by_rank}
    if not equal_plan(sampler) and len(set(weighted.values())) > 1:
        yes = min(r for r, w in weighted.items() if w)
        no = min(r for r, w in weighted.items() if not w)
        raise ValidationError(
            f"rank {yes} weights its gradient for the uneven plan {_shown(list(sampler.batch_sizes))} (weighted hook, "
            f"micro_steps or a loss scale) before its first batch but rank {no} does not; call "
            "register_weighted_hook(model, sampler) on every rank")


def arm_weighting_check(sampler: HeteroBatchSampler) -> None:
    """At a pass start of an uneven plan under torch.distributed, with no weighting known yet: check at the first
    backward through the DDP model that some weighting form has run by then, and raise the one line if none has.

    Local (no collective), so every rank running the same script raises the same line at the same point -- before
    its first gradient all-reduce, since the check sits on the DDP output's gradient, which backward computes
    before any parameter's. The loss-scale forms are called between the forward and the backward of that first
    step, so they count; DataLoader workers running the sampler ahead do not matter (forward and backward run in
    training order). Mechanism: one global module forward pre-hook, removed at the first training forward (grad
    enabled, train mode) of a module with trainable parameters -- the DDP model, whose output then gets the check;
    any other module (an FSDP2 model, a model without DDP) ends the watch with no check. It acts only in the
    training process's main thread.
    """
    global _watch
    if _WEIGHTING or equal_plan(sampler) or not _distributed() or not on_main_thread():
        return
    message = _weighting_message(sampler)
    if _watch is not None:
        _watch.message = message  # a re-plan's sizes
        return
    handle = torch.nn.modules.module.register_module_forward_pre_hook(_first_forward)
    _watch = _Watch(message=message, pid=os.getpid(), handle=handle)


def _disarm() -> None:
    global _watch
    if _watch is not None:
        _watch.handle.remove()
        _watch = None


def _first_forward(module: torch.nn.Module, args: Any) -> None:
    watch = _watch
    if watch is None or watch.pid != os.getpid() or not on_main_thread():
        return  # a forked DataLoader worker inherits the hook: inert there
    if _WEIGHTING:
        _disarm()
        return
    if not (torch.is_grad_enabled() and module.training) or not any(p.requires_grad for p in module.parameters()):
        return  # an evaluation forward, or a module without trainable parameters (a GPU transform): keep watching
    _disarm()
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        message = watch.message

        def on_output(mod: torch.nn.Module, inputs: Any, output: Any) -> None:
            handle.remove()
            _check_on_backward(output, message)

        handle = module.register_forward_hook(on_output)


def _tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v, depth + 1)


def _check_on_backward(output: Any, message: str) -> None:
    fired = False

    def check(grad: torch.Tensor) -> None:
        nonlocal fired
        if not fired:
            fired = True
            if not _WEIGHTING:
                raise ValidationError(message)

    for t in _tensors(output):
        if t.requires_grad:
            t.register_hook(check)
