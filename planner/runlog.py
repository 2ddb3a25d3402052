"""The run log: typed records, one writer, one reader (a contract beside Profile and Plan).

``planner train --log-file run.jsonl`` (and the framework adapters) write one JSON object per line; ``planner
report --log`` and ``planner validate`` read it; ``planner/schemas/runlog.schema.json`` describes one line::

    {"event": "start",  "time": t, "world_size": W, "global_batch": B, "strategy": "plan", "plan": {...},
                        "dataset_size": N, "grad_compress": "bf16"  (optional: absent when uncompressed),
                        "replanner": {...}  (optional: the re-planner's configuration, Replanner.describe())}
    {"event": "epoch",  "epoch": e, "plan_fingerprint": "..", "samples_per_s": x, "step_time_s": y, "loss": l,
                        "batch_sizes": [...], "ranks": [<StepStats per rank>], "predicted_step_time_s": [...],
                        "device_state": [<DeviceState per rank, or null>]  (optional),
                        "wall_s": seconds, "samples": n  (optional: the epoch by the wall clock)}
    {"event": "replan", "epoch": e, "adopted": bool, "reason": "..", "predicted_gain": g,
                        "old_batch_sizes": [...], "new_batch_sizes": [...], "measured_compute_s": [...],
                        "predicted_compute_s": [...], "plan": {...} | null,
                        "inputs": {"state": {...}, "stats": [...]}  (optional: what the decision read)}
    {"event": "revert", ... the same fields as "replan": the adopted plan measured slower and was taken back}
    {"event": "resize", "time": t, "epoch": e, "step": s, "old_world_size": .., "new_world_size": ..,
                        "old_batch_sizes": [...], "new_batch_sizes": [...], "plan": {...}}
    {"event": "end",    "time": t, "epochs": n, "reason": ".." (only when the run stopped early)}

Numbers that are not finite (a diverged loss, a rank that ran no step) are written as null, so every line is
strict JSON.  The reader is tolerant where a log can legitimately differ -- unknown keys and event kinds are
ignored (a newer writer may log more), and a truncated last line (what a killed run leaves) is skipped and
counted -- and strict where it cannot: a malformed line in the middle, or a record whose known fields have the
wrong type, is a ValidationError naming the line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from planner.argcheck import MAX_COUNT
from planner.devstate import DeviceState
from planner.errors import ValidationError
from planner.jsonio import (
    INT64_MAX,
    MAX_RUN_LOG_BYTES,
    MAX_TIME_S,
    MAX_WORLD_SIZE,
    JSONDict,
    loads_strict,
    read_text_bounded,
)
from planner.plan import Plan
from planner.shown import shown
from planner.stats import Diagnosis, StepStats

RUNLOG_VERSION = 1
_STATS_KEYS = frozenset(f.name for f in fields(StepStats))


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _finites(xs: Sequence[float | None]) -> list[float | None]:
    return [_finite(x) for x in xs]


def _json_safe(v: Any) -> Any:
    """``v`` with every non-finite float as None (a NaN a rank measured must not make the line invalid JSON)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


# -- records ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class StartRecord:
    time: float
    world_size: int | None
    global_batch: int | None
    strategy: str = "plan"
    """'plan' (HeteroBatchSampler + exact weighting) or 'equal' (DistributedSampler)."""
    plan: Plan | None = None
    dataset_size: int | None = None
    """Samples in the training dataset (what an epoch covers): the report's epoch times use it."""
    grad_compress: str = "none"
    """Wire dtype of the gradient all-reduce ('bf16', 'fp16'; runtime/compress.py); 'none', the default, is
    written by leaving the key out (a log without it is uncompressed)."""
    replanner: Mapping[str, Any] | None = None
    """The re-planner's configuration (``runtime.replan.Replanner.describe()``: profile, threshold, noise, solve
    options, ...), with which each replan record's ``inputs`` replays offline; None: not re-planning, or an older
    log."""
    event: Literal["start"] = "start"

    def to_dict(self) -> JSONDict:
        d = {"event": self.event, "version": RUNLOG_VERSION, "time": self.time, "world_size": self.world_size,
             "global_batch": self.global_batch, "strategy": self.strategy,
             "plan": self.plan.to_dict() if self.plan is not None else None}
        if self.grad_compress != "none":
            d["grad_compress"] = self.grad_compress
        if self.replanner is not None:
            d["replanner"] = _json_safe(self.replanner)
        return d if self.dataset_size is None else {**d, "dataset_size": self.dataset_size}


def predicted_step_times(plan: Plan) -> tuple[float, ...]:
    """Per rank, the prediction an epoch record carries for ``plan``: its one per-rank prediction
    (``RankPlan.timer_busy_s``), the number its table prints; ``planner.plan.synchronous_step_s`` of them and the
    plan's exposed communication is its predicted step.  Every writer of epoch records takes them from here."""
    return tuple(r.timer_busy_s for r in plan.ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochRecord:
    epoch: int
    plan_fingerprint: str
    samples_per_s: float | None
    step_time_s: float | None
    """Measured mean synchronous step time (slowest rank + communication)."""
    loss: float | None
    batch_sizes: tuple[int, ...]
    predicted_step_time_s: tuple[float, ...]
    """Per-rank prediction of the plan in force this epoch (``predicted_step_times``: the plan table's per-rank
    step), what the step timer's busy time (compute span plus data wait) is compared with."""
    ranks: tuple[StepStats, ...] = ()
    """What every rank measured this epoch, in rank order."""
    device_state: tuple[DeviceState | None, ...] = ()
    """Every rank's device and host state sampled at this epoch's end, in rank order (None: not sampled)."""
    wall_s: float | None = None
    """Wall seconds of the epoch's training loop, its first batch's wait and its warm-up steps included (what a
    clock on the wall sees; ``samples_per_s`` is the step timer's pace over the epoch's timed steps)."""
    samples: int | None = None
    """Samples the epoch trained, all ranks together (``samples / wall_s`` is the epoch's wall-clock throughput)."""
    diagnosis: tuple[Diagnosis, ...] = ()
    """Ranks measured slower than their prediction beyond the epoch's noise, each with its named cause
    (runtime.diagnose); () when every rank ran on plan, or in older logs."""
    event: Literal["epoch"] = "epoch"

    @property
    def wall_samples_per_s(self) -> float | None:
        """The epoch's throughput by the wall clock; None when the log does not record it (older logs)."""
        return self.samples / self.wall_s if self.samples and self.wall_s else None

    @property
    def drained(self) -> bool:
        """Whether the epoch lies wholly in its loaders' drain (``StepStats.drain_steps``: a streamed run's last
        epochs): its pace is the GPUs' on batches built before, not what the loaders sustain."""
        return any(s.drain_steps and s.drain_steps >= s.num_steps for s in self.ranks)

    @property
    def drain_steps(self) -> int:
        """Steps of the epoch in its loaders' drain (the most any rank counted; 0 when none)."""
        return max((s.drain_steps or 0 for s in self.ranks), default=0)

    @property
    def measured_compute_s(self) -> tuple[float, ...]:
        return tuple(s.compute_s for s in self.ranks)

    @property
    def measured_data_wait_s(self) -> tuple[float, ...]:
        return tuple(s.data_wait_s for s in self.ranks)

    @property
    def measured_step_time_s(self) -> tuple[float, ...]:
        return tuple(s.step_time_s for s in self.ranks)

    @property
    def measured_busy_s(self) -> tuple[float, ...]:
        """Per-rank own time (``StepStats.busy_s``: compute + data wait, the whole step where the loader paced the
        rank; never below the loader's measured period, up to the step itself): the measured counterpart of the
        predicted per-rank step time (no peer waiting)."""
        return tuple(s.busy_s for s in self.ranks)

    def to_dict(self) -> JSONDict:
        return {"event": self.event, "epoch": self.epoch, "plan_fingerprint": self.plan_fingerprint,
                "samples_per_s": _finite(self.samples_per_s), "step_time_s": _finite(self.step_time_s),
                "loss": _finite(self.loss), "batch_sizes": list(self.batch_sizes),
                "ranks": [{k: (_finite(v) if isinstance(v, float) else v) for k, v in s.to_dict().items()}
                          for s in self.ranks],
                "predicted_step_time_s": _finites(self.predicted_step_time_s),
                **({"device_state": [None if s is None else s.to_dict() for s in self.device_state]}
                   if any(s is not None for s in self.device_state) else {}),
                **({"wall_s": _finite(self.wall_s), "samples": self.samples} if self.wall_s is not None else {}),
                **({"diagnosis": [d.to_dict() for d in self.diagnosis]} if self.diagnosis else {})}


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanRecord:
    """A re-plan decision at an epoch end (``event`` 'replan'), or a revert (``event`` 'revert'): the plan adopted
    before measured slower than its predecessor and was taken back."""

    epoch: int
    adopted: bool
    reason: str
    predicted_gain: float | None
    """Relative step-time gain the re-planner predicted for the new split (0.05 = 5% faster)."""
    old_batch_sizes: tuple[int, ...]
    new_batch_sizes: tuple[int, ...]
    measured_compute_s: tuple[float | None, ...] = ()
    predicted_compute_s: tuple[float | None, ...] = ()
    plan: Plan | None = None
    """The plan for the next epoch when one was adopted, or when the running plan's prediction was re-made (the
    same batches and fingerprint, the step the model now predicts: what the next epochs are compared against)."""
    event: Literal["replan", "revert"] = "replan"
    inputs: Mapping[str, Any] | None = None
    """Everything the decision read: ``{"state": the re-planner's state before it, "stats": [every rank's
    StepStats as a dict]}`` (non-finite numbers as null); with the start record's ``replanner`` it replays
    exactly (benchmarks/replan_replay.py).  None: an older log."""

    @property
    def reverted(self) -> bool:
        return self.event == "revert"

    def to_dict(self) -> JSONDict:
        d = {"event": self.event, "epoch": self.epoch, "adopted": self.adopted, "reason": self.reason,
             "predicted_gain": _finite(self.predicted_gain), "old_batch_sizes": list(self.old_batch_sizes),
             "new_batch_sizes": list(self.new_batch_sizes),
             "measured_compute_s": _finites(self.measured_compute_s),
             "predicted_compute_s": _finites(self.predicted_compute_s),
             "plan": self.plan.to_dict() if self.plan is not None else None}
        if self.inputs is not None:
            d["inputs"] = _json_safe(self.inputs)
        return d


@dataclass(frozen=True, kw_only=True, slots=True)
class ResizeRecord:
    """A resume with another world size (elastic restart): same global batch, the new ranks' split."""

    time: float
    epoch: int
    step: int
    old_world_size: int
    new_world_size: int
    old_batch_sizes: tuple[int, ...]
    new_batch_sizes: tuple[int, ...]
    plan: Plan | None = None
    event: Literal["resize"] = "resize"

    def to_dict(self) -> JSONDict:
        return {"event": self.event, "time": self.time, "epoch": self.epoch, "step": self.step,
                "old_world_size": self.old_world_size, "new_world_size": self.new_world_size,
                "old_batch_sizes": list(self.old_batch_sizes), "new_batch_sizes": list(self.new_batch_sizes),
                "plan": self.plan.to_dict() if self.plan is not None else None}


INTERRUPTED = "interrupted"
"""The end record's reason for a run stopped by Ctrl-C or SIGTERM (`planner train`): `validate` calls it interrupted."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EndRecord:
    time: float
    epochs: int
    """Epochs completed."""
    reason: str | None = None
    """Why the run stopped early ("loss diverged at epoch 1 step 3"); None when it ran every epoch."""
    event: Literal["end"] = "end"

    def to_dict(self) -> JSONDict:
        d: JSONDict = {"event": self.event, "time": self.time, "epochs": self.epochs}
        if self.reason is not None:
            d["reason"] = self.reason
        return d


Record = StartRecord | EpochRecord | ReplanRecord | ResizeRecord | EndRecord


# -- the writer -----------------------------------------------------------------------------------------------
class RunLogWriter:
    """Appends records as JSON lines, flushed per line (a killed run loses at most the line being written).

    Only the writing rank opens the file: ``RunLogWriter(path, enabled=rank == 0)``; elsewhere it is a no-op.  It
    writes through the descriptor the run holds the log by (planner.paths.hold_exclusive: the file checked and
    locked is the one written, never a link swapped in later); a full disk is one line naming the file.
    """

    def __init__(self, path: str | os.PathLike[str] | None, *, enabled: bool = True, flag: str = "--log-file") -> None:
        self._path = os.fspath(path) if path else None
        self._fd: int | None = None
        self._pending: list[str] | None = None
        if path and enabled:
            from planner.paths import hold_exclusive

            self._fd = hold_exclusive(self._path or "", flag)

    def write(self, record: Record) -> None:
        if self._fd is None:
            return
        # allow_nan=False: a non-finite number that slipped past to_dict is our bug, not a line to write.
        line = json.dumps(record.to_dict(), allow_nan=False) + "\n"
        if self._pending is not None:
            self._pending.append(line)
            return
        self._write(line)

    def _write(self, text: str) -> None:
        from planner.paths import write_all, write_error

        assert self._fd is not None and self._path is not None
        try:
            write_all(self._fd, text.encode("utf-8"))  # unbuffered: each record reaches the file as written
        except OSError as e:
            raise write_error(self._path, e) from None

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Hold the records written inside the block and write them when it ends (also when it raises): the
        trainer saves an epoch's checkpoint inside it, so a log write that fails (a full disk) comes after the
        epoch is safe, never before."""
        if self._pending is not None:  # nested: the outer block writes them
            yield
            return
        self._pending = []
        try:
            yield
        except BaseException:
            held, self._pending = self._pending, None
            if held and self._fd is not None:
                try:
                    self._write("".join(held))
                except ValidationError:  # the block's own error is the one to report
                    pass
            raise
        held, self._pending = self._pending, None
        if held and self._fd is not None:
            self._write("".join(held))

    def close(self) -> None:
        if self._fd is not None:
            from planner.paths import release

            release(self._fd)
            self._fd = None

    def __enter__(self) -> RunLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- the reader -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class RunLog:
    world_size: int | None
    global_batch: int | None
    start_plan: Plan | None
    """The plan the run started with (None when the start event is missing or its plan does not parse)."""
    epochs: tuple[EpochRecord, ...]
    replans: tuple[ReplanRecord, ...]
    """Re-plan decisions and reverts, in order."""
    resizes: tuple[ResizeRecord, ...] = ()
    ended: bool = False
    """The last record is an end record: the run finished or stopped (a killed run has none)."""
    end_reason: str | None = None
    """The end record's reason when the run stopped early (a diverged loss)."""
    num_skipped_lines: int = 0
    """Truncated trailing lines (a run killed mid-write)."""
    runs: int = 1
    """Start records in the file: more than one when a fresh run appended to an old log (the trainer now
    refuses that); only the last run's records are read."""
    dataset_size: int | None = None
    """Samples per epoch, from the start record (None for logs written before it was recorded)."""
    grad_compress: str = "none"
    """Wire dtype of the run's gradient all-reduce, from the start record ('none' for logs without it)."""
    replanner: Mapping[str, Any] | None = None
    """The re-planner's configuration, from the start record (None for logs without it)."""

    def steady_epoch(self) -> EpochRecord | None:
        """The last epoch that measured its plan at the loaders' steady pace: none of its steps in the run's final
        drain (batches built before, at the GPUs' pace) and not the first epoch of its plan (epoch 0 or a re-plan's
        first, which fill the loaders from nothing), when the log has one; else the last epoch.  What a per-rank
        prediction check reads (2x H100: epoch 3, 112 of its 120 steps in the drain, put rank 1 at
        -14 to -18% where epoch 2 had it within 5%)."""
        if not self.epochs:
            return None
        firsts = self.plan_starts()
        steady = [e for e in self.epochs if not e.drain_steps and e.epoch not in firsts]
        return steady[-1] if steady else self.epochs[-1]

    def plan_starts(self) -> set[int]:
        """The epochs that begin a plan: the log's first and each whose plan differs from the epoch before (an
        adopted re-plan's first, which a streamed loader refills from nothing)."""
        return {e.epoch for i, e in enumerate(self.epochs)
                if i == 0 or e.plan_fingerprint != self.epochs[i - 1].plan_fingerprint}


def _num(d: Mapping[str, Any], key: str, where: str, *, non_negative: bool = False,
         max_value: float | None = None) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValidationError(f"{where}: '{key}' must be a number or null, got {shown(v)}")
    if non_negative and v < 0:
        raise ValidationError(f"{where}: '{key}' must be >= 0, got {v:g}; not a run log this planner wrote")
    if max_value is not None and v > max_value:
        raise ValidationError(f"{where}: '{key}' must be <= {max_value:g}, got {v:g}; not a run log this "
                              "planner wrote")
    return float(v)


def _int(d: Mapping[str, Any], key: str, where: str, default: int | None = None, *, lo: int = 0,
         hi: int = MAX_COUNT) -> int:
    """An integer field in [lo, hi] (counts, epochs, steps: never negative, at most MAX_COUNT by default)."""
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValidationError(f"{where}: '{key}' must be an integer, got {shown(v)}")
    if not lo <= v <= hi:
        raise ValidationError(f"{where}: '{key}' must be in {lo:,}..{hi:,}, got {v:,}; not a run log this planner "
                              "wrote")
    return v


def _opt_int(d: Mapping[str, Any], key: str, where: str, *, lo: int = 0, hi: int = MAX_COUNT) -> int | None:
    return None if d.get(key) is None else _int(d, key, where, lo=lo, hi=hi)


def _nums(v: Any, key: str, where: str) -> tuple[float | None, ...]:
    """A per-rank list of times: numbers >= 0 (null: not measured), one per rank at most."""
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_WORLD_SIZE \
            or not all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= MAX_TIME_S)
                       for x in v):
        raise ValidationError(f"{where}: '{key}' must be a list of at most {MAX_WORLD_SIZE:,} times in seconds "
                              f"(numbers in 0..{MAX_TIME_S:g}, or null), got {shown(v)}")
    return tuple(None if x is None else float(x) for x in v)


def _ints(v: Any, key: str, where: str) -> tuple[int, ...]:
    """A per-rank list of batch sizes: integers in 0..MAX_COUNT, one per rank at most."""
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_WORLD_SIZE \
            or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT for x in v):
        raise ValidationError(f"{where}: '{key}' must be a list of at most {MAX_WORLD_SIZE:,} integers in "
                              f"0..{MAX_COUNT:,}, got {shown(v)}")
    return tuple(v)


_TIME_KEYS = ("data_wait_s", "compute_s", "step_time_s", "compute_s_std")


def _stats(r: Mapping[str, Any], where: str) -> StepStats:
    known = {k: v for k, v in r.items() if k in _STATS_KEYS}
    if known.get("num_steps") == 0:
        # A rank that ran no step this epoch has no times: the writer logged them as null.
        known = {k: (0.0 if v is None else v) for k, v in known.items()}
    # A time the writer could not measure (non-finite) was logged as null: it reads back as NaN, "missing", which
    # the report shows as "-" -- never as a number it is not.
    missing = [k for k in _TIME_KEYS if k in known and known[k] is None]
    stats = StepStats.from_dict({**known, **dict.fromkeys(missing, 0.0)}, path=where)
    return replace(stats, **{k: math.nan for k in missing}) if missing else stats  # type: ignore[arg-type]


def _device_states(v: Any, where: str) -> tuple[DeviceState | None, ...]:
    if v is None:
        return ()
    if not isinstance(v, list):
        raise ValidationError(f"{where}: 'device_state' must be a list (one object or null per rank)")
    # Unknown keys inside are ignored like everywhere in the log: a newer profiler may sample more.
    return tuple(None if s is None else DeviceState.from_dict(s, f"{where}.device_state[{i}]", strict=False)
                 for i, s in enumerate(v))


def _diagnosis(v: Any, where: str) -> tuple[Diagnosis, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_WORLD_SIZE:
        raise ValidationError(f"{where}: 'diagnosis' must be a list of per-rank objects (one per slow rank)")
    return tuple(Diagnosis.from_dict(x, f"{where}.diagnosis[{i}]") for i, x in enumerate(v))


def _obj(v: Any, key: str, where: str) -> Mapping[str, Any] | None:
    if v is None:
        return None
    if not isinstance(v, dict):
        raise ValidationError(f"{where}: '{key}' must be an object or null, got {type(v).__name__}")
    return v


def _inputs(v: Any, where: str) -> Mapping[str, Any] | None:
    """A replan record's ``inputs``: an object with a ``state`` object and a ``stats`` list of objects."""
    d = _obj(v, "inputs", where)
    if d is None:
        return None
    if not isinstance(d.get("state"), dict) or not isinstance(d.get("stats"), list) \
            or not all(isinstance(x, dict) for x in d["stats"]):
        raise ValidationError(f"{where}: 'inputs' must hold a 'state' object and a 'stats' list of objects")
    return d


def _plan(v: Any, where: str, *, strict: bool) -> Plan | None:
    if v is None:
        return None
    try:
        return Plan.from_dict(v, path=f"{where}.plan")
    except ValidationError as e:
        if strict:
            text = str(e)
            raise ValidationError(text if text.startswith(where) else f"{where}.plan: {text}") from None
        return None  # the report still shows measured numbers without it


def parse_record(d: Mapping[str, Any], where: str = "record", *, strict_plans: bool = False) -> Record | None:
    """One line's record; None for an event kind this version does not know (ignored by design)."""
    kind = d.get("event")
    if kind == "start":
        start = StartRecord(time=_num(d, "time", where, non_negative=True) or 0.0,
                            world_size=_opt_int(d, "world_size", where, lo=1, hi=MAX_WORLD_SIZE),
                            global_batch=_opt_int(d, "global_batch", where, lo=1), strategy=str(d.get("strategy", "plan")),
                            plan=_plan(d.get("plan"), where, strict=strict_plans),
                            dataset_size=_opt_int(d, "dataset_size", where, hi=INT64_MAX),
                            grad_compress=str(d.get("grad_compress") or "none"),
                            replanner=_obj(d.get("replanner"), "replanner", where))
        for field, value in (("world_size", start.world_size), ("global_batch", start.global_batch)):
            planned = getattr(start.plan, field) if start.plan is not None else None
            if value is not None and planned is not None and value != planned:
                raise ValidationError(f"{where}: {field} {value} but the run's plan has {planned}; not a run log "
                                      "this planner wrote")
        return start
    if kind == "epoch":
        ranks = d.get("ranks") or []
        if not isinstance(ranks, list) or len(ranks) > MAX_WORLD_SIZE or not all(isinstance(r, dict) for r in ranks):
            raise ValidationError(f"{where}: 'ranks' must be a list of per-rank StepStats objects")
        stats = tuple(sorted((_stats(r, f"{where}.ranks[{i}]") for i, r in enumerate(ranks)), key=lambda s: s.rank))
        batches = _ints(d.get("batch_sizes"), "batch_sizes", where) or tuple(s.batch_size for s in stats)
        # null (not measured) stays in its place as NaN: rank i's prediction must stay at index i.
        predicted = tuple(math.nan if x is None else x
                          for x in _nums(d.get("predicted_step_time_s"), "predicted_step_time_s", where))
        return EpochRecord(epoch=_int(d, "epoch", where, 0), plan_fingerprint=str(d.get("plan_fingerprint", "")),
                           samples_per_s=_num(d, "samples_per_s", where, non_negative=True),
                           step_time_s=_num(d, "step_time_s", where, non_negative=True, max_value=MAX_TIME_S),
                           loss=_num(d, "loss", where), batch_sizes=batches, predicted_step_time_s=predicted,
                           ranks=stats, device_state=_device_states(d.get("device_state"), where),
                           wall_s=_num(d, "wall_s", where, non_negative=True),
                           samples=_opt_int(d, "samples", where, hi=INT64_MAX),
                           diagnosis=_diagnosis(d.get("diagnosis"), where))
    if kind in ("replan", "revert"):
        return ReplanRecord(epoch=_int(d, "epoch", where, 0), adopted=bool(d.get("adopted", False)),
                            reason=str(d.get("reason", "")), predicted_gain=_num(d, "predicted_gain", where),
                            old_batch_sizes=_ints(d.get("old_batch_sizes"), "old_batch_sizes", where),
                            new_batch_sizes=_ints(d.get("new_batch_sizes"), "new_batch_sizes", where),
                            measured_compute_s=_nums(d.get("measured_compute_s"), "measured_compute_s", where),
                            predicted_compute_s=_nums(d.get("predicted_compute_s"), "predicted_compute_s", where),
                            plan=_plan(d.get("plan"), where, strict=strict_plans),
                            event="revert" if kind == "revert" else "replan", inputs=_inputs(d.get("inputs"), where))
    if kind == "resize":
        return ResizeRecord(time=_num(d, "time", where, non_negative=True) or 0.0, epoch=_int(d, "epoch", where),
                            step=_int(d, "step", where),
                            old_world_size=_int(d, "old_world_size", where, lo=1, hi=MAX_WORLD_SIZE),
                            new_world_size=_int(d, "new_world_size", where, lo=1, hi=MAX_WORLD_SIZE),
                            old_batch_sizes=_ints(d.get("old_batch_sizes"), "old_batch_sizes", where),
                            new_batch_sizes=_ints(d.get("new_batch_sizes"), "new_batch_sizes", where),
                            plan=_plan(d.get("plan"), where, strict=strict_plans))
    if kind == "end":
        reason = d.get("reason")
        return EndRecord(time=_num(d, "time", where, non_negative=True) or 0.0, epochs=_int(d, "epochs", where, 0),
                         reason=None if reason is None else str(reason))
    return None


def read_run_log(path: str | os.PathLike[str], *, strict_plans: bool = False) -> RunLog:
    """Parse a run log (see the module docstring for what is tolerated).

    Raises:
        ValidationError: the file is missing or unreadable, a line other than the last is not a JSON object, a
            known record has a field of the wrong type, or the file holds no start, epoch or replan record.
    """
    p = Path(path)
    lines = read_text_bounded(p, "run log", limit=MAX_RUN_LOG_BYTES).splitlines()
    numbered = [(i + 1, s) for i, s in enumerate(lines) if s.strip()]
    records: list[Record] = []
    skipped = 0
    for k, (lineno, text) in enumerate(numbered):
        try:
            obj = loads_strict(text, "record")
        except ValidationError as e:
            raise ValidationError(f"{p}:{lineno}: {e}") from None
        except json.JSONDecodeError as e:
            if k == len(numbered) - 1:
                skipped += 1  # a run killed mid-write leaves half a line; everything before it is good
                continue
            raise ValidationError(f"{p}:{lineno}: not a JSON line ({e.msg}); is this a `planner train --log` file?") from None
        except (ValueError, RecursionError) as e:
            raise ValidationError(f"{p}:{lineno}: {e}") from None
        if not isinstance(obj, dict):
            raise ValidationError(f"{p}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
        rec = parse_record(obj, f"{p}:{lineno}", strict_plans=strict_plans)
        if rec is not None:
            records.append(rec)
    starts = [r for r in records if isinstance(r, StartRecord)]
    if len(starts) > 1:  # several runs appended to one file: the last one is the run this log is about
        last = max(i for i, r in enumerate(records) if isinstance(r, StartRecord))
        records = records[last:]
    epochs = tuple(r for r in records if isinstance(r, EpochRecord))
    replans = tuple(r for r in records if isinstance(r, ReplanRecord))
    if not epochs and not replans and not starts:
        raise ValidationError(f"{p}: no start, epoch or replan events; is this a `planner train --log` file?")
    start = starts[-1] if starts else None
    return RunLog(
        world_size=start.world_size if start else None,
        global_batch=start.global_batch if start else None,
        start_plan=start.plan if start else None,
        epochs=epochs,
        replans=replans,
        resizes=tuple(r for r in records if isinstance(r, ResizeRecord)),
        # The last record decides: a run that ended, was resumed and then killed has an end record in the middle.
        ended=bool(records) and isinstance(records[-1], EndRecord),
        num_skipped_lines=skipped,
        runs=max(1, len(starts)),
        end_reason=records[-1].reason if records and isinstance(records[-1], EndRecord) else None,
        dataset_size=start.dataset_size if start else None,
        grad_compress=start.grad_compress if start else "none",
        replanner=start.replanner if start else None,
    )

