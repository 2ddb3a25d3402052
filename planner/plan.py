"""The plan: per-rank batch sizes, dataset shares and loader workers. Frozen types and JSON (``kind: "plan"``).

The fingerprint hashes what every rank must agree on (world size, global batch, min batch, each rank's batch
and workers; with gradient accumulation also each rank's micro-batch and micro-step count, and the mode when it
is not "ddp"); ranks compare it before the first collective, so two ranks launched with different plans fail
with a clear error instead of hanging.

Gradient accumulation.  Rank i's optimizer step is ``accumulation_steps`` (k_i) micro-steps whose micro-batches
are its ``batch_size`` b_i split as evenly as possible, larger ones first (``micro_batch_sizes``), so
``micro_batch_size`` = ceil(b_i / k_i) is the largest one, the one that must fit the rank's memory.  A plan
without the two fields is one micro-step of ``batch_size``; they are written (and fingerprinted) only when some
rank accumulates, so every plan without accumulation reads, writes and hashes as one without those fields.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from planner.argcheck import MAX_COUNT
from planner.ddp_settings import ddp_settings_from
from planner.errors import ValidationError
from planner.jsonio import (
    MAX_WORLD_SIZE,
    JSONDict,
    as_int,
    as_list,
    as_num,
    as_obj,
    as_seconds,
    as_str,
    check_header,
    fingerprint,
    opt,
    read_json,
    write_json_atomic,
)
from planner.launchenv import check_launch_env
from planner.options import MODES, SolveOptions
from planner.shown import shown

PLAN_VERSION = 1
MAX_LOADER_WORKERS = 1024
"""Loader workers a plan may give one rank: a bound on processes, whatever the host."""
Bottleneck = Literal["compute", "loader", "memory"]
BOTTLENECKS: tuple[str, ...] = ("compute", "loader", "memory")
_ACCUMULATION_FIELDS = ("micro_batch_size", "accumulation_steps")


def micro_batch_sizes(batch_size: int, accumulation_steps: int) -> list[int]:
    """``batch_size`` split into ``accumulation_steps`` micro-batches as evenly as possible, larger ones first.

    >>> micro_batch_sizes(10, 3)
    [4, 3, 3]

    Raises:
        ValidationError: fewer than one micro-step, or more micro-steps than samples (an empty micro-batch).
    """
    if accumulation_steps < 1 or batch_size < accumulation_steps:
        raise ValidationError(
            f"cannot split a batch of {batch_size} into {accumulation_steps} non-empty micro-batches"
        )
    q, r = divmod(batch_size, accumulation_steps)
    return [q + 1] * r + [q] * (accumulation_steps - r)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankPlan:
    rank: int
    batch_size: int
    """Local batch size: samples this rank processes per global step."""
    share: float
    """Fraction of the dataset this rank sees per epoch = batch_size / global_batch."""
    num_workers: int
    """DataLoader workers for this rank (0 = load in the training process)."""
    predicted_step_time_s: float
    """This rank's predicted step before waiting for the others (``planner.solve.rank_step_s``): max(compute,
    loader) alone, under DDP its forward and backward stretched by the span factor the profile measured.  The one
    per-rank prediction: the plan's table prints it, ``synchronous_step_s`` makes the plan's step of it, the run log
    and the report compare the ranks' step timers with it (``timer_busy_s``)."""
    bottleneck: Bottleneck
    """What limits this rank: "memory" (at its batch cap), "loader" (data slower than compute) or "compute"."""
    device: str = ""
    host: str = ""
    max_batch_size: int | None = None
    """The cap the solver used for this rank (memory fit, measured max or --max-batch-per-rank)."""
    predicted_compute_s: float | None = None
    predicted_loader_s: float | None = None
    predicted_busy_s: float | None = None
    """Read from plans written before ``predicted_step_time_s`` held the span under DDP itself: what the rank's
    step timer should read as busy there (its compute span under DDP plus its data wait).  New plans leave it out:
    ``predicted_step_time_s`` is the one per-rank prediction.  None: ``predicted_step_time_s``."""
    accumulation_steps: int = 1
    """Micro-steps (forward+backward) per optimizer step; 1 = no gradient accumulation."""
    micro_batch_size: int = 0
    """Largest micro-batch, ceil(batch_size / accumulation_steps) (0 in a constructor call means derive it):
    what must fit the rank's memory. The micro-batches are ``micro_batch_sizes(batch_size, accumulation_steps)``."""

    @property
    def timer_busy_s(self) -> float:
        """The rank's predicted step, what its step timer's busy time is compared with: ``predicted_step_time_s``
        (an older plan's ``predicted_busy_s`` where it has one).  Every reader of a per-rank prediction -- the plan
        table, the plan's step (``synchronous_step_s``), the run log, the report -- takes this number."""
        return self.predicted_step_time_s if self.predicted_busy_s is None else self.predicted_busy_s

    def __post_init__(self) -> None:
        if not 0 <= self.num_workers <= MAX_LOADER_WORKERS:
            raise ValidationError(f"rank {self.rank}: num_workers {self.num_workers} is outside 0..{MAX_LOADER_WORKERS} "
                                  "(each is a forked process; no host has more cores)")
        b, k = self.batch_size, self.accumulation_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValidationError(f"rank {self.rank}: accumulation_steps must be an integer >= 1, got {k!r}")
        if k > b:
            raise ValidationError(f"rank {self.rank}: {k} accumulation steps for a batch of {b} leave a micro-batch "
                                  "empty")
        if self.micro_batch_size == 0:
            object.__setattr__(self, "micro_batch_size", -(-b // k))
        m = self.micro_batch_size
        # The largest of the even split: m * k >= b (the micro-batches hold the batch) and (m - 1) * k < b (none
        # larger than needed).  "m * (k - 1) >= b" is not the test: 4 in 3 micro-steps is 2, 1, 1.
        if m * k < b or (m - 1) * k >= b:
            raise ValidationError(
                f"rank {self.rank}: micro_batch_size {m} x accumulation_steps {k} does not split batch_size {b} "
                f"(its micro-batches are {_shown(micro_batch_sizes(b, k))}: micro_batch_size {-(-b // k)})"
            )
        if k > 1 and self.max_batch_size is not None and m > self.max_batch_size:
            raise ValidationError(self.over_cap_message())

    def over_cap_message(self) -> str:
        return (f"rank {self.rank}: micro_batch_size {self.micro_batch_size} is above the rank's max_batch_size "
                f"{self.max_batch_size} (its memory cap): it would run out of memory; re-run `planner plan`")

    @property
    def micro_batches(self) -> list[int]:
        """This rank's micro-batch sizes in one optimizer step (larger first)."""
        return micro_batch_sizes(self.batch_size, self.accumulation_steps)


def _shown(sizes: Sequence[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 4 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"


def synchronous_step_s(rank_steps: Sequence[float], comm_s: float) -> float:
    """The synchronous step of ranks predicted to take ``rank_steps`` (``RankPlan.timer_busy_s``) with ``comm_s`` of
    exposed communication: the slowest rank plus the communication.  The one formula for a plan's step (its
    ``predicted.step_time_s``, hence its samples/s = global batch / step) and for the predicted step the report
    reads back from a run log's per-rank predictions."""
    return max(rank_steps) + comm_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    step_time_s: float
    """Synchronous step time: slowest rank + exposed communication (``synchronous_step_s``)."""
    samples_per_s: float
    equal_split_samples_per_s: float
    """What DistributedSampler gives: B split equally, default workers; 0 when the equal split does not fit."""
    ideal_samples_per_s: float
    """sum_i b_i / t_i(b_i) at the planned batches: every rank flat out, nobody waiting."""
    equal_split_step_time_s: float | None = None
    comm_s: float = 0.0
    """Exposed communication time added to every synchronous step (``planner.solve.exposed_comm_s``: under DDP
    with span factors the tail measured after the stretched spans, else the exposed time at the equal split)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    world_size: int
    global_batch: int
    ranks: tuple[RankPlan, ...]
    predicted: Predicted
    min_batch: int = 1
    solver: Mapping[str, Any] = field(default_factory=dict)
    """How the plan was found (method, status, solve time, profile fingerprint): not part of the fingerprint."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    mode: str = "ddp"
    """"ddp": every rank runs its own number of micro-steps; "fsdp": all run the same (each forward all-gathers)."""
    launch_env: Mapping[str, str] = field(default_factory=dict)
    """Environment the job is to be launched with (e.g. {"NCCL_MAX_CTAS": "2"}): only a setting the profile
    measured to help on this cluster (profile.comm.launch_env).  `planner train` applies it before the process
    group starts; `planner plan --print-env` prints it as export lines.  Empty: NCCL's defaults."""
    made_for: Mapping[str, Any] = field(default_factory=dict)
    """What the plan was solved for (``planner.solve.made_for``): ``profile_fingerprint`` (the content hash of the
    profile it came from), ``model`` (``name``, ``num_params``, ``structure``: the hash of its parameters' and
    buffers' ordered names, shapes and dtypes) and ``ranks`` (each rank's ``device``, ``device_name``, ``host`` and
    the host's ``cpu_cores``).  Every run compares them with itself at start (runtime.workload).  Empty: a plan
    written before plans recorded it, or made by hand -- it cannot be checked.  Not part of the fingerprint."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "launch_env", check_launch_env(self.launch_env, "plan.launch_env"))
        if self.mode not in MODES:
            raise ValidationError(f"plan.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.world_size != len(self.ranks):
            raise ValidationError(
                f"plan.world_size is {self.world_size} but plan.ranks lists {len(self.ranks)} ranks"
            )
        ids = [r.rank for r in self.ranks]
        if ids != list(range(self.world_size)):
            raise ValidationError(f"plan.ranks: must list ranks 0..{self.world_size - 1} in order, got {ids}")
        total = sum(r.batch_size for r in self.ranks)
        if total != self.global_batch:
            raise ValidationError(
                f"plan: rank batch sizes sum to {total} but global_batch is {self.global_batch}; "
                "re-run `planner plan` rather than editing batch sizes by hand"
            )
        for r in self.ranks:
            if r.batch_size < self.min_batch:
                raise ValidationError(
                    f"plan.ranks[{r.rank}].batch_size {r.batch_size} is below min_batch {self.min_batch}"
                )
            # share is the rank's part of every epoch: batch_size / global_batch, written to 6 decimals at most.
            if not abs(r.share - r.batch_size / self.global_batch) <= 1e-6:
                raise ValidationError(
                    f"plan.ranks[{r.rank}].share is {r.share:.6g} but its batch {r.batch_size} of {self.global_batch} "
                    f"is {r.batch_size / self.global_batch:.6g}: the plan was edited by hand -- re-run `planner plan` "
                    "(or `planner plan --from-batches`)"
                )
        recorded = self.solver.get("options")
        if recorded is not None:  # what a report or re-plan re-solves under: refused here, not only there
            if not isinstance(recorded, Mapping):
                raise ValidationError(f"plan.solver.options: expected an object, got {type(recorded).__name__}")
            SolveOptions.from_dict(recorded, path="plan.solver.options")
            if r.batch_size // r.accumulation_steps < self.min_batch:
                raise ValidationError(
                    f"plan.ranks[{r.rank}]: {r.accumulation_steps} micro-batches of a batch of {r.batch_size} hold "
                    f"{r.batch_size // r.accumulation_steps} samples, below min_batch {self.min_batch}"
                )
        steps = self.accumulation_steps
        if self.mode == "fsdp" and len(set(steps)) > 1:
            raise ValidationError(
                f"plan.mode is fsdp but the ranks run {list(steps)} accumulation steps: under FSDP every rank must "
                "run the same number of micro-steps (each forward all-gathers); re-run `planner plan --mode fsdp`"
            )

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(r.batch_size for r in self.ranks)

    @property
    def accumulation_steps(self) -> tuple[int, ...]:
        return tuple(r.accumulation_steps for r in self.ranks)

    @property
    def accumulates(self) -> bool:
        """True when some rank runs more than one micro-step per optimizer step."""
        return any(r.accumulation_steps > 1 for r in self.ranks)

    @property
    def options(self) -> SolveOptions:
        """The solve options this plan was made with (``solver["options"]``; defaults where it records none),
        with the plan's own min batch: what a re-plan or a report re-solves under."""
        recorded = self.solver.get("options")
        base = SolveOptions.from_dict(recorded, path="plan.solver.options") if isinstance(recorded, Mapping) else SolveOptions()
        return base.with_overrides({"min_batch": self.min_batch, "mode": self.mode})

    @property
    def fingerprint(self) -> str:
        """Hash of the semantic content every rank must agree on.

        The accumulation fields and the mode enter only when they differ from the defaults (some rank
        accumulates; mode not "ddp"), so a plan without accumulation hashes the same whether or not its file spells them out."""
        content: JSONDict = {
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "min_batch": self.min_batch,
            "ranks": [[r.rank, r.batch_size, r.num_workers] for r in self.ranks],
        }
        if self.accumulates:
            content["ranks"] = [[r.rank, r.batch_size, r.num_workers, r.micro_batch_size, r.accumulation_steps]
                                for r in self.ranks]
        if self.mode != "ddp":
            content["mode"] = self.mode
        if self.launch_env:  # ranks launched with different NCCL settings would build mismatched communicators
            content["launch_env"] = dict(sorted(self.launch_env.items()))
        return fingerprint(content)

    def with_batch_sizes(self, batch_sizes: Sequence[int], accumulation_steps: Sequence[int] | None = None) -> Plan:
        """A copy with new batch sizes (same global batch), shares and micro-batches recomputed; every rank keeps
        its micro-step count unless ``accumulation_steps`` gives new ones."""
        steps = self.accumulation_steps if accumulation_steps is None else accumulation_steps
        ranks = tuple(
            replace(r, batch_size=int(b), share=int(b) / self.global_batch, accumulation_steps=int(k),
                    micro_batch_size=0)
            for r, b, k in zip(self.ranks, batch_sizes, steps, strict=True)
        )
        return replace(self, ranks=ranks)

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> JSONDict:
        accumulates = self.accumulates

        def rank(r: RankPlan) -> JSONDict:
            # The accumulation fields beside batch_size; left out when no rank accumulates (the file an older
            # reader knows: one micro-step everywhere).
            names = [n for n in r.__slots__ if n not in _ACCUMULATION_FIELDS]
            if accumulates:
                names[names.index("batch_size") + 1:1] = ["micro_batch_size", "accumulation_steps"]
            d = {name: getattr(r, name) for name in names}
            return {k: v for k, v in d.items() if v is not None}

        p = self.predicted
        mode: JSONDict = {} if self.mode == "ddp" else {"mode": self.mode}
        launch: JSONDict = {"launch_env": dict(self.launch_env)} if self.launch_env else {}
        made: JSONDict = {"made_for": dict(self.made_for)} if self.made_for else {}
        return {
            "version": self.version,
            "kind": "plan",
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "min_batch": self.min_batch,
            **mode,
            "fingerprint": self.fingerprint,
            "ranks": [rank(r) for r in self.ranks],
            "predicted": {k: v for k in p.__slots__ if (v := getattr(p, k)) is not None},
            **launch,
            **made,
            "solver": dict(self.solver),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Any, path: str = "plan") -> Plan:
        check_header(data, path, kind="plan", version=PLAN_VERSION)
        d = as_obj(
            data,
            path,
            required=("version", "kind", "world_size", "global_batch", "fingerprint", "ranks", "predicted"),
            allowed=("min_batch", "solver", "meta", "mode", "launch_env", "made_for"),
        )
        ranks = tuple(
            _rank_from(r, f"{path}.ranks[{i}]") for i, r in enumerate(as_list(d["ranks"], f"{path}.ranks", non_empty=True,
                                                                                max_items=MAX_WORLD_SIZE))
        )
        pp = f"{path}.predicted"
        pd = as_obj(
            d["predicted"],
            pp,
            required=("step_time_s", "samples_per_s", "equal_split_samples_per_s", "ideal_samples_per_s"),
            allowed=("equal_split_step_time_s", "comm_s"),
        )
        est = opt(pd, "equal_split_step_time_s")
        predicted = Predicted(
            step_time_s=as_seconds(pd["step_time_s"], f"{pp}.step_time_s", positive=True),
            samples_per_s=as_num(pd["samples_per_s"], f"{pp}.samples_per_s", positive=True),
            equal_split_samples_per_s=as_num(pd["equal_split_samples_per_s"], f"{pp}.equal_split_samples_per_s", non_negative=True),
            ideal_samples_per_s=as_num(pd["ideal_samples_per_s"], f"{pp}.ideal_samples_per_s", positive=True),
            equal_split_step_time_s=None if est is None else as_seconds(est, f"{pp}.equal_split_step_time_s"),
            comm_s=as_seconds(pd.get("comm_s", 0.0), f"{pp}.comm_s"),
        )
        solver = as_obj(d["solver"], f"{path}.solver", allowed=tuple(d["solver"])) if opt(d, "solver") is not None else {}
        meta = as_obj(d["meta"], f"{path}.meta", allowed=tuple(d["meta"])) if opt(d, "meta") is not None else {}
        ddp_settings_from(meta)  # applied by train and every loop, so refused here: validate says what they would
        mode = as_str(d.get("mode", "ddp"), f"{path}.mode")
        launch_env = {}
        if opt(d, "launch_env") is not None:
            env = as_obj(d["launch_env"], f"{path}.launch_env", allowed=tuple(d["launch_env"]))
            launch_env = check_launch_env(env, f"{path}.launch_env")
        if mode not in MODES:
            raise ValidationError(f"{path}.mode: {mode!r} is not one of {', '.join(MODES)}")
        plan = cls(
            world_size=as_int(d["world_size"], f"{path}.world_size", min_value=1, max_value=MAX_WORLD_SIZE),
            global_batch=as_int(d["global_batch"], f"{path}.global_batch", min_value=1, max_value=MAX_COUNT),
            min_batch=as_int(d.get("min_batch", 1), f"{path}.min_batch", min_value=1, max_value=MAX_COUNT),
            ranks=ranks,
            predicted=predicted,
            solver=solver,
            meta=meta,
            mode=mode,
            launch_env=launch_env,
            made_for={} if opt(d, "made_for") is None else _made_for_from(d["made_for"], f"{path}.made_for",
                                                                          len(ranks)),
        )
        got = as_str(d["fingerprint"], f"{path}.fingerprint")
        if got != plan.fingerprint:
            raise ValidationError(
                f"{path}.fingerprint: file says {got} but its content hashes to {plan.fingerprint}; the plan was "
                "edited by hand -- re-run `planner plan` (or `planner plan --from-batches`)"
            )
        return plan

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        return cls.from_dict(read_json(path, "plan"), path=str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())


def _name(d: Mapping[str, Any], key: str, path: str) -> str:
    """An optional name of a plan rank (device, host): "" when absent, else a name as ``as_str`` bounds it."""
    v = d.get(key)
    return "" if v is None or v == "" else as_str(v, f"{path}.{key}")


def _rank_from(v: Any, path: str) -> RankPlan:
    d = as_obj(
        v,
        path,
        required=("rank", "batch_size", "share", "num_workers", "predicted_step_time_s", "bottleneck"),
        allowed=("device", "host", "max_batch_size", "predicted_compute_s", "predicted_loader_s", "predicted_busy_s",
                 *_ACCUMULATION_FIELDS),
    )
    if ("micro_batch_size" in d) != ("accumulation_steps" in d):
        raise ValidationError(f"{path}: give both micro_batch_size and accumulation_steps, or neither (one micro-step)")
    bottleneck = d["bottleneck"]
    if bottleneck not in BOTTLENECKS:
        raise ValidationError(f"{path}.bottleneck: {shown(bottleneck)} is not one of {', '.join(BOTTLENECKS)}")
    mb, pc, pl = opt(d, "max_batch_size"), opt(d, "predicted_compute_s"), opt(d, "predicted_loader_s")
    pb = opt(d, "predicted_busy_s")
    given = "micro_batch_size" in d
    fields: JSONDict = {
        "rank": as_int(d["rank"], f"{path}.rank", min_value=0),
        "batch_size": as_int(d["batch_size"], f"{path}.batch_size", min_value=1, max_value=MAX_COUNT),
        "share": as_num(d["share"], f"{path}.share", non_negative=True),
        "num_workers": as_int(d["num_workers"], f"{path}.num_workers", min_value=0),
        "predicted_step_time_s": as_seconds(d["predicted_step_time_s"], f"{path}.predicted_step_time_s"),
        "bottleneck": bottleneck,
        "device": _name(d, "device", path),
        "host": _name(d, "host", path),
        "max_batch_size": None if mb is None else as_int(mb, f"{path}.max_batch_size", min_value=1, max_value=MAX_COUNT),
        "predicted_compute_s": None if pc is None else as_seconds(pc, f"{path}.predicted_compute_s"),
        "predicted_loader_s": None if pl is None else as_seconds(pl, f"{path}.predicted_loader_s"),
        "predicted_busy_s": None if pb is None else as_seconds(pb, f"{path}.predicted_busy_s"),
        "accumulation_steps": as_int(d.get("accumulation_steps", 1), f"{path}.accumulation_steps", min_value=1,
                                     max_value=MAX_COUNT),
        "micro_batch_size": as_int(d["micro_batch_size"], f"{path}.micro_batch_size", min_value=1,
                                   max_value=MAX_COUNT) if given else 0,
    }
    try:
        r = RankPlan(**fields)
    except ValidationError as e:  # "rank N: what is wrong" -> "<path>: what is wrong"
        raise ValidationError(f"{path}: {str(e).split(': ', 1)[-1]}") from None
    if given and r.max_batch_size is not None and r.micro_batch_size > r.max_batch_size:
        raise ValidationError(f"{path}: {r.over_cap_message().split(': ', 1)[-1]}")
    return r


_MADE_FOR_RANK = {"rank": "int", "device": "str", "device_name": "str", "host": "str", "cpu_cores": "int"}
_MADE_FOR_MODEL = {"name": "str", "num_params": "int", "structure": "str"}


def _made_for_from(v: Any, path: str, world_size: int) -> JSONDict:
    """``plan.made_for`` read strictly (every field optional; a rank entry per plan rank, in order)."""
    d = as_obj(v, path, allowed=("profile_fingerprint", "model", "ranks"))

    def fields(obj: Any, where: str, kinds: Mapping[str, str]) -> JSONDict:
        o = as_obj(obj, where, allowed=tuple(kinds))
        return {k: (as_int(x, f"{where}.{k}", min_value=0) if kinds[k] == "int" else as_str(x, f"{where}.{k}"))
                for k, x in o.items()}

    out: JSONDict = {}
    if opt(d, "profile_fingerprint") is not None:
        out["profile_fingerprint"] = as_str(d["profile_fingerprint"], f"{path}.profile_fingerprint")
    if opt(d, "model") is not None:
        out["model"] = fields(d["model"], f"{path}.model", _MADE_FOR_MODEL)
    if opt(d, "ranks") is not None:
        ranks = [fields(r, f"{path}.ranks[{i}]", _MADE_FOR_RANK) for i, r in enumerate(as_list(d["ranks"], f"{path}.ranks"))]
        if [r.get("rank", i) for i, r in enumerate(ranks)] != list(range(world_size)):
            raise ValidationError(f"{path}.ranks: must describe ranks 0..{world_size - 1} in order, got "
                                  f"{len(ranks)} entries")
        out["ranks"] = ranks
    return out
