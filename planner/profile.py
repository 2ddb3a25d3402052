"""The profile: what each rank measured. Frozen value types and their JSON form (``kind: "profile"``).

The minimal file (docs/DESIGN.md, Profile JSON) loads as written; every other field is optional. Validation is strict:
unknown keys are refused (typos such as ``step_time`` for ``step_time_s`` would otherwise be silently
ignored); free-form data goes under ``meta``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from planner.devstate import DeviceState
from planner.errors import ValidationError
from planner.jsonio import (
    MAX_CPU_CORES,
    MAX_TIME_S,
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

PROFILE_VERSION = 1




def _check_finite(value: float, what: str, *, positive: bool) -> None:
    # The JSON readers check the same; this catches profiles built in code, so NaN/inf/negative times never
    # reach the solver by any path.
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValidationError(f"{what} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    if value > MAX_TIME_S:
        raise ValidationError(f"{what} is {value:g} s, more than {MAX_TIME_S:g} s (11.6 days): not a measurement; "
                              "re-measure")


def _time(value: Any, path: str, *, positive: bool) -> float:
    """A time field of the JSON: finite, in range, and the field path in the message.  A file's nonzero time is
    also at least MIN_TIME_S (``as_seconds``): no measurement is shorter, whatever a profile built in code holds."""
    x = as_seconds(value, path, positive=positive)
    _check_finite(x, path, positive=positive)
    return x


MAX_BATCH = 2**31 - 1  # planner.argcheck.MAX_COUNT: every sum and product of batches stays exact in int64


def _batch(value: Any, path: str) -> int:
    b = as_int(value, path, min_value=1)
    if b > MAX_BATCH:
        raise ValidationError(f"{path}: must be <= {MAX_BATCH}, got {b}")
    return b


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputePoint:
    batch_size: int
    """Local batch size of the measured step."""
    step_time_s: float
    """Median wall time of one full training step (forward, backward, optimizer), no communication."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValidationError(f"compute point batch_size must be >= 1, got {self.batch_size}")
        _check_finite(self.step_time_s, f"compute point step_time_s (batch {self.batch_size})", positive=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryPoint:
    batch_size: int
    peak_bytes: int
    """Peak allocated device bytes during a training step at this batch size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryProfile:
    capacity_bytes: int | None = None
    """Device memory in bytes; None means no cap is derived from the points."""
    points: tuple[MemoryPoint, ...] = ()
    max_batch_size: int | None = None
    """Largest batch the profiler ran without running out of memory (a hard cap when present)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderPoint:
    num_workers: int
    samples_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderProfile:
    sec_per_sample: float
    """CPU seconds one dataloader worker spends to produce one sample (fetch, decode, transform, collate share)."""
    scaling: tuple[LoaderPoint, ...] = ()
    """Measured DataLoader throughput with 1..k workers on the otherwise idle host: the curve the planner models
    the loader with under host contention (planner.loader); without it the model uses sec_per_sample."""
    max_workers: int | None = None
    """Most dataloader workers this rank may run (e.g. a capped or emulated-starved node); None = host budget."""
    sample_bytes: int | None = None
    """Bytes of one collated sample (its tensors): what the training process receives and pins per sample."""
    handover_bytes_per_s: float | None = None
    """Bytes per second the training process's pinning thread copies a delivered batch into pinned memory while
    the host's workers build at full load (one thread for every rank's batches: a ceiling on the batch a rank
    can take per step, planner.loader.handover_costs_s); None when not measured (no CUDA, an older profile)."""

    def __post_init__(self) -> None:
        _check_finite(self.sec_per_sample, "loader sec_per_sample", positive=False)
        hb = self.handover_bytes_per_s
        if hb is not None and not (math.isfinite(hb) and hb > 0):
            raise ValidationError(f"loader handover_bytes_per_s must be a finite number > 0, got {hb}")


@dataclass(frozen=True, kw_only=True, slots=True)
class HostProfile:
    name: str
    cpu_cores: int
    """Cores usable by this job on the host (sched_getaffinity), shared by every rank's loader workers."""
    memory_bytes: int | None = None

    def to_dict(self) -> JSONDict:
        return _drop_none(_asdict(self))

    @classmethod
    def from_dict(cls, data: Any, path: str = "host") -> HostProfile:
        return _host_from(data, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    name: str
    num_params: int | None = None
    grad_bytes: int | None = None
    structure: str | None = None
    """Structural fingerprint of the profiled model: a hash of the ordered (name, shape, dtype) of its parameters
    and buffers (runtime.workload.model_fingerprint).  A plan records it; a run on another model is refused."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CommProfile:
    backend: str | None = None
    allreduce_s: float | None = None
    """Time of one all-reduce of the whole gradient (bucketed like DDP) on the job's backend."""
    exposed_s: float | None = None
    """Part of a synchronous step's communication not hidden behind backward, plus the optimizer tail.
    When absent it is estimated from allreduce_s (see planner.solve)."""
    wait_factors: tuple[float, ...] | None = None
    """f_i by rank (>= 1): rank i's compute under DDP at a balanced split over its standalone compute, i.e. how
    much the all-reduce kernels waiting for a later peer slow its backward (planner.comm_model).  None: 1."""
    launch_env: Mapping[str, str] | None = None
    """A launch setting the profile measured to help (e.g. {"NCCL_MAX_CTAS": "2"}); wait_factors and exposed_s
    were measured under it.  None: NCCL's defaults (nothing measured better)."""
    span_factors: tuple[float, ...] | None = None
    """By rank (>= 1): the rank's compute span under DDP (forward start to its last gradient bucket, what
    ``runtime.timing`` measures) over its standalone step less the optimizer step, at the profile's balanced split:
    the backward shares the device with the all-reduce of the buckets before its last one.  The plan's per-rank
    prediction, and so its step, reads it (``planner.solve.rank_step_s``); the solve never does (the split
    balances the standalone curves).  On 2x H200: 1.015-1.051.  None: not measured (one rank, or older
    profiles)."""
    span_tail_s: float | None = None
    """With ``span_factors``: what the synchronous step adds after the slowest rank's span under DDP and its
    optimizer step, at the same balanced split the factors were measured at (median step - max_i (span_i + o_i),
    >= 0): the last bucket's all-reduce and DDP's per-step work.  The plan's step under DDP is the slowest
    stretched rank plus this tail (``planner.solve.exposed_comm_s``).  ``exposed_s`` is taken against the
    standalone steps at the equal split, so it already holds the slowest rank's stretch: added to stretched ranks
    it counts the stretch twice.  None: not measured (older profiles use ``exposed_s``)."""
    grad_compress: str | None = None
    """The wire format of the gradients in the DDP steps behind ``exposed_s``, ``span_factors`` and ``span_tail_s``
    ("bf16" or "fp16", ``planner profile --grad-compress``); None: uncompressed.  A run sending another format
    than its profile measured is warned that its prediction does not hold (``planner train``)."""

    def __post_init__(self) -> None:
        if self.launch_env is not None:
            object.__setattr__(self, "launch_env", check_launch_env(self.launch_env, "comm.launch_env"))


@dataclass(frozen=True, kw_only=True, slots=True)
class RankProfile:
    rank: int
    host: str
    device: str
    compute: tuple[ComputePoint, ...]
    memory: MemoryProfile | None = None
    loader: LoaderProfile | None = None
    device_name: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Free-form facts (NVML, emulation settings...)."""
    device_state: DeviceState | None = None
    """The device's and host's state while the compute sweep ran: other processes, clocks, throttling,
    affinity, load. Evidence for why a rank measured slow; the solver never reads it."""
    optimizer_step_s: float | None = None
    """Seconds of one optimizer step (zero_grad excluded), part of every ``compute`` time.  With gradient
    accumulation the planner charges it once per optimizer step and the rest of t(b) once per micro-step.
    Absent (None) counts as 0, which charges the optimizer on every micro-step: conservative, it over-estimates
    an accumulating rank's step by (k - 1) optimizer steps and so never plans more micro-steps than pay off."""

    def __post_init__(self) -> None:
        if self.optimizer_step_s is not None:
            _check_finite(self.optimizer_step_s, f"rank {self.rank} optimizer_step_s", positive=False)

    def to_dict(self) -> JSONDict:
        """The rank's entry of the profile JSON (what ranks exchange when a profile is gathered)."""
        return _rank_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any, path: str = "rank") -> RankProfile:
        return _rank_from(data, path)


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    hosts: tuple[HostProfile, ...]
    ranks: tuple[RankProfile, ...]
    model: ModelInfo | None = None
    comm: CommProfile | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValidationError("profile.ranks: must list at least one rank")
        ids = [r.rank for r in self.ranks]
        if sorted(ids) != list(range(len(ids))):
            raise ValidationError(
                f"profile.ranks: rank ids must be 0..{len(ids) - 1} each exactly once, got {sorted(ids)}"
            )
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names):
            raise ValidationError(f"profile.hosts: duplicate host name in {names}")
        for r in self.ranks:
            if r.host not in names:
                raise ValidationError(
                    f"profile.ranks[{r.rank}].host: {r.host!r} is not in profile.hosts ({', '.join(names) or 'none'}); "
                    "add it with its cpu_cores"
                )

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def has_loader(self) -> bool:
        """Whether any rank's loader was profiled (the run feeds a DataLoader, not batches made on the device)."""
        return any(r.loader is not None for r in self.ranks)

    def rank(self, i: int) -> RankProfile:
        return self.by_rank[i]

    @property
    def by_rank(self) -> tuple[RankProfile, ...]:
        """Ranks ordered by rank id (the file may list them in any order)."""
        return tuple(sorted(self.ranks, key=lambda r: r.rank))

    def host(self, name: str) -> HostProfile:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def fingerprint(self) -> str:
        return fingerprint(self.to_dict())

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> JSONDict:
        return _drop_none(
            {
                "version": self.version,
                "kind": "profile",
                "hosts": [_drop_none(_asdict(h)) for h in self.hosts],
                "ranks": [_rank_to_dict(r) for r in self.ranks],
                "model": _drop_none(_asdict(self.model)) if self.model else None,
                "comm": _comm_to_dict(self.comm) if self.comm else None,
                "meta": dict(self.meta) or None,
            }
        )

    @classmethod
    def from_dict(cls, data: Any, path: str = "profile") -> Profile:
        check_header(data, path, kind="profile", version=PROFILE_VERSION)
        d = as_obj(data, path, required=("version", "kind", "hosts", "ranks"), allowed=("model", "comm", "meta"))
        hosts = tuple(_host_from(h, f"{path}.hosts[{i}]")
                      for i, h in enumerate(as_list(d["hosts"], f"{path}.hosts", max_items=MAX_WORLD_SIZE)))
        ranks = tuple(
            _rank_from(r, f"{path}.ranks[{i}]") for i, r in enumerate(as_list(d["ranks"], f"{path}.ranks", non_empty=True,
                                                                                max_items=MAX_WORLD_SIZE))
        )
        model = _model_from(d["model"], f"{path}.model") if opt(d, "model") is not None else None
        comm = _comm_from(d["comm"], f"{path}.comm") if opt(d, "comm") is not None else None
        meta = as_obj(d["meta"], f"{path}.meta", allowed=tuple(d["meta"])) if opt(d, "meta") is not None else {}
        return cls(hosts=hosts, ranks=ranks, model=model, comm=comm, meta=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_dict(read_json(path, "profile"), path=str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    def with_compute_times(self, time_at: Callable[[int, int, float], float]) -> Profile:
        """A copy (hosts, model, comm, meta and memory/loader kept) whose compute point of rank i at batch b,
        measured at t seconds, takes ``time_at(i, b, t)`` seconds: how a re-plan or a what-if rescales curves."""
        ranks = tuple(
            replace(r, compute=tuple(ComputePoint(batch_size=p.batch_size,
                                                  step_time_s=time_at(r.rank, p.batch_size, p.step_time_s))
                                     for p in r.compute))
            for r in self.ranks
        )
        return replace(self, ranks=ranks)

    def scaled(self, factors: Sequence[float]) -> Profile:
        """Every compute time of rank i multiplied by ``factors[i]`` (a rank f x slower: factor f)."""
        if len(factors) != self.world_size:
            raise ValidationError(f"{len(factors)} scale factors for a profile of {self.world_size} ranks")
        return self.with_compute_times(lambda i, _b, t: float(factors[i]) * t)


def _asdict(obj: Any) -> JSONDict:
    return {name: getattr(obj, name) for name in obj.__slots__}


def _drop_none(d: JSONDict) -> JSONDict:
    return {k: v for k, v in d.items() if v is not None}


def _comm_to_dict(c: CommProfile) -> JSONDict:
    d = _drop_none(_asdict(c))
    if c.wait_factors is not None:
        d["wait_factors"] = list(c.wait_factors)
    if c.launch_env is not None:
        d["launch_env"] = dict(c.launch_env)
    if c.span_factors is not None:
        d["span_factors"] = list(c.span_factors)
    return d


def _rank_to_dict(r: RankProfile) -> JSONDict:
    mem = None
    if r.memory is not None:
        mem = _drop_none(
            {
                "capacity_bytes": r.memory.capacity_bytes,
                "points": [_asdict(p) for p in r.memory.points],
                "max_batch_size": r.memory.max_batch_size,
            }
        )
    loader: JSONDict | None = None
    if r.loader is not None:
        loader = {"sec_per_sample": r.loader.sec_per_sample}
        if r.loader.scaling:
            loader["scaling"] = [_asdict(p) for p in r.loader.scaling]
        if r.loader.max_workers is not None:
            loader["max_workers"] = r.loader.max_workers
        if r.loader.sample_bytes is not None:
            loader["sample_bytes"] = r.loader.sample_bytes
        if r.loader.handover_bytes_per_s is not None:
            loader["handover_bytes_per_s"] = r.loader.handover_bytes_per_s
    return _drop_none(
        {
            "rank": r.rank,
            "host": r.host,
            "device": r.device,
            "device_name": r.device_name,
            "compute": [_asdict(p) for p in r.compute],
            "memory": mem,
            "loader": loader,
            "optimizer_step_s": r.optimizer_step_s,
            "meta": dict(r.meta) or None,
            "device_state": r.device_state.to_dict() if r.device_state is not None else None,
        }
    )


def _host_from(v: Any, path: str) -> HostProfile:
    d = as_obj(v, path, required=("name", "cpu_cores"), allowed=("memory_bytes",))
    mem = opt(d, "memory_bytes")
    return HostProfile(
        name=as_str(d["name"], f"{path}.name"),
        cpu_cores=as_int(d["cpu_cores"], f"{path}.cpu_cores", min_value=1, max_value=MAX_CPU_CORES),
        memory_bytes=None if mem is None else as_int(mem, f"{path}.memory_bytes", min_value=0),
    )


def _rank_from(v: Any, path: str) -> RankProfile:
    d = as_obj(
        v, path, required=("rank", "host", "device", "compute"),
        allowed=("memory", "loader", "device_name", "meta", "device_state", "optimizer_step_s"),
    )
    compute = []
    for j, p in enumerate(as_list(d["compute"], f"{path}.compute", non_empty=True)):
        pp = f"{path}.compute[{j}]"
        pd = as_obj(p, pp, required=("batch_size", "step_time_s"))
        compute.append(
            ComputePoint(
                batch_size=_batch(pd["batch_size"], f"{pp}.batch_size"),
                step_time_s=_time(pd["step_time_s"], f"{pp}.step_time_s", positive=True),
            )
        )
    memory = _memory_from(d["memory"], f"{path}.memory") if opt(d, "memory") is not None else None
    loader = _loader_from(d["loader"], f"{path}.loader") if opt(d, "loader") is not None else None
    meta = as_obj(d["meta"], f"{path}.meta", allowed=tuple(d["meta"])) if opt(d, "meta") is not None else {}
    name = opt(d, "device_name")
    state = opt(d, "device_state")
    o = opt(d, "optimizer_step_s")
    return RankProfile(
        rank=as_int(d["rank"], f"{path}.rank", min_value=0),
        host=as_str(d["host"], f"{path}.host"),
        device=as_str(d["device"], f"{path}.device"),
        device_name=None if name is None else as_str(name, f"{path}.device_name"),
        compute=tuple(compute),
        memory=memory,
        loader=loader,
        meta=meta,
        device_state=None if state is None else DeviceState.from_dict(state, f"{path}.device_state"),
        optimizer_step_s=None if o is None else as_num(o, f"{path}.optimizer_step_s", non_negative=True),
    )


def _memory_from(v: Any, path: str) -> MemoryProfile:
    d = as_obj(v, path, allowed=("capacity_bytes", "points", "max_batch_size"))
    points = []
    for j, p in enumerate(as_list(d.get("points", []), f"{path}.points")):
        pp = f"{path}.points[{j}]"
        pd = as_obj(p, pp, required=("batch_size", "peak_bytes"))
        points.append(
            MemoryPoint(
                batch_size=_batch(pd["batch_size"], f"{pp}.batch_size"),
                peak_bytes=as_int(pd["peak_bytes"], f"{pp}.peak_bytes", min_value=0),
            )
        )
    cap = opt(d, "capacity_bytes")
    mx = opt(d, "max_batch_size")
    return MemoryProfile(
        capacity_bytes=None if cap is None else as_int(cap, f"{path}.capacity_bytes", min_value=1),
        points=tuple(points),
        max_batch_size=None if mx is None else _batch(mx, f"{path}.max_batch_size"),
    )


def _loader_from(v: Any, path: str) -> LoaderProfile:
    d = as_obj(v, path, required=("sec_per_sample",),
               allowed=("scaling", "max_workers", "sample_bytes", "handover_bytes_per_s"))
    scaling = []
    for j, p in enumerate(as_list(d.get("scaling", []), f"{path}.scaling")):
        pp = f"{path}.scaling[{j}]"
        pd = as_obj(p, pp, required=("num_workers", "samples_per_s"))
        scaling.append(
            LoaderPoint(
                num_workers=as_int(pd["num_workers"], f"{pp}.num_workers", min_value=0),
                samples_per_s=as_num(pd["samples_per_s"], f"{pp}.samples_per_s", positive=True),
            )
        )
    mw, sb, hb = opt(d, "max_workers"), opt(d, "sample_bytes"), opt(d, "handover_bytes_per_s")
    return LoaderProfile(
        sec_per_sample=_time(d["sec_per_sample"], f"{path}.sec_per_sample", positive=False),
        scaling=tuple(scaling),
        max_workers=None if mw is None else as_int(mw, f"{path}.max_workers", min_value=1),
        sample_bytes=None if sb is None else as_int(sb, f"{path}.sample_bytes", min_value=0),
        handover_bytes_per_s=None if hb is None else as_num(hb, f"{path}.handover_bytes_per_s", positive=True),
    )


def _model_from(v: Any, path: str) -> ModelInfo:
    d = as_obj(v, path, required=("name",), allowed=("num_params", "grad_bytes", "structure"))
    n, g, st = opt(d, "num_params"), opt(d, "grad_bytes"), opt(d, "structure")
    return ModelInfo(
        name=as_str(d["name"], f"{path}.name"),
        num_params=None if n is None else as_int(n, f"{path}.num_params", min_value=0),
        grad_bytes=None if g is None else as_int(g, f"{path}.grad_bytes", min_value=0),
        structure=None if st is None else as_str(st, f"{path}.structure"),
    )


def _comm_from(v: Any, path: str) -> CommProfile:
    d = as_obj(v, path, allowed=("backend", "allreduce_s", "exposed_s", "wait_factors", "launch_env", "span_factors",
                                 "span_tail_s", "grad_compress"))
    b, a, e = opt(d, "backend"), opt(d, "allreduce_s"), opt(d, "exposed_s")
    w, env, sf, tail = opt(d, "wait_factors"), opt(d, "launch_env"), opt(d, "span_factors"), opt(d, "span_tail_s")
    factors = None
    if w is not None:
        factors = tuple(as_num(x, f"{path}.wait_factors[{i}]", positive=True)
                        for i, x in enumerate(as_list(w, f"{path}.wait_factors", non_empty=True)))
    spans = None
    if sf is not None:
        spans = tuple(as_num(x, f"{path}.span_factors[{i}]", positive=True)
                      for i, x in enumerate(as_list(sf, f"{path}.span_factors", non_empty=True)))
    launch = None
    if env is not None:
        obj = as_obj(env, f"{path}.launch_env", allowed=tuple(env) if isinstance(env, dict) else ())
        launch = check_launch_env(obj, f"{path}.launch_env")
    return CommProfile(
        backend=None if b is None else as_str(b, f"{path}.backend"),
        allreduce_s=None if a is None else _time(a, f"{path}.allreduce_s", positive=False),
        exposed_s=None if e is None else _time(e, f"{path}.exposed_s", positive=False),
        wait_factors=factors,
        launch_env=launch,
        span_factors=spans,
        span_tail_s=None if tail is None else _time(tail, f"{path}.span_tail_s", positive=False),
        grad_compress=_wire_format(opt(d, "grad_compress"), f"{path}.grad_compress"),
    )


WIRE_FORMATS = ("bf16", "fp16")
"""The compressed wire formats a profile may have measured (``CommProfile.grad_compress``)."""
GRAD_COMPRESSIONS = ("none", *WIRE_FORMATS)
"""What ``--grad-compress`` (planner train, planner profile) and ``register_weighted_hook(..., compress=)`` accept:
uncompressed or a wire format."""


def _wire_format(v: Any, path: str) -> str | None:
    if v is None:
        return None
    name = as_str(v, path)
    if name not in WIRE_FORMATS:
        raise ValidationError(f"{path}: {name!r} is not a gradient wire format; one of {', '.join(WIRE_FORMATS)}")
    return name
