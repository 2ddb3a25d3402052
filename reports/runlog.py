"""Reading a training run log (JSON lines written by ``planner train --log run.jsonl``).

One event per line::

    {"event": "start", "time": ..., "world_size": W, "global_batch": B, "plan": {...}}
    {"event": "epoch", "epoch": e, "plan_fingerprint": "...", "samples_per_s": x, "step_time_s": y, "loss": l,
     "ranks": [<StepStats dict per rank>], "predicted_step_time_s": [per-rank predicted]}
    {"event": "replan", "epoch": e, "adopted": bool, "reason": "...", "predicted_gain": g,
     "old_batch_sizes": [...], "new_batch_sizes": [...], "measured_compute_s": [...], "predicted_compute_s": [...],
     "plan": {...} | null}
    {"event": "end", "time": ..., "epochs": n}

The reader is tolerant by design: unknown keys and unknown event kinds are ignored (the trainer may log more
than the report needs), and a truncated last line -- what a killed run leaves behind -- is skipped and counted.
A malformed line in the middle is an error: it means the file is not a run log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import ValidationError
from planner.plan import Plan


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
    """Per-rank predicted busy time of the plan in force this epoch (max of compute and loader)."""
    measured_compute_s: tuple[float, ...]
    measured_data_wait_s: tuple[float, ...]
    measured_step_time_s: tuple[float, ...]

    @property
    def measured_busy_s(self) -> tuple[float, ...]:
        """Per-rank compute + data wait: the measured counterpart of the predicted busy time (no peer waiting)."""
        return tuple(c + d for c, d in zip(self.measured_compute_s, self.measured_data_wait_s, strict=True))


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanRecord:
    epoch: int
    adopted: bool
    reason: str
    predicted_gain: float | None
    """Relative step-time gain the re-planner predicted for the new split (0.05 = 5% faster)."""
    old_batch_sizes: tuple[int, ...]
    new_batch_sizes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunLog:
    world_size: int | None
    global_batch: int | None
    start_plan: Plan | None
    """The plan the run started with (None when the start event is missing or its plan does not parse)."""
    epochs: tuple[EpochRecord, ...]
    replans: tuple[ReplanRecord, ...]
    num_skipped_lines: int = 0
    """Truncated trailing lines (a run killed mid-write)."""


def _num(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _floats(v: Any) -> tuple[float, ...]:
    if not isinstance(v, Sequence) or isinstance(v, str):
        return ()
    return tuple(float(x) for x in v if isinstance(x, (int, float)) and not isinstance(x, bool))


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in _floats(v))


def _epoch(d: Mapping[str, Any], where: str) -> EpochRecord:
    ranks = d.get("ranks") or []
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise ValidationError(f"{where}: 'ranks' must be a list of per-rank StepStats objects")
    ranks = sorted(ranks, key=lambda r: int(r.get("rank", 0)))

    def col(key: str) -> tuple[float, ...]:
        return tuple(float(r.get(key, 0.0)) for r in ranks)

    return EpochRecord(
        epoch=int(d.get("epoch", 0)),
        plan_fingerprint=str(d.get("plan_fingerprint", "")),
        samples_per_s=_num(d, "samples_per_s"),
        step_time_s=_num(d, "step_time_s"),
        loss=_num(d, "loss"),
        batch_sizes=tuple(int(r.get("batch_size", 0)) for r in ranks),
        predicted_step_time_s=_floats(d.get("predicted_step_time_s")),
        measured_compute_s=col("compute_s"),
        measured_data_wait_s=col("data_wait_s"),
        measured_step_time_s=col("step_time_s"),
    )


def _replan(d: Mapping[str, Any]) -> ReplanRecord:
    return ReplanRecord(
        epoch=int(d.get("epoch", 0)),
        adopted=bool(d.get("adopted", False)),
        reason=str(d.get("reason", "")),
        predicted_gain=_num(d, "predicted_gain"),
        old_batch_sizes=_ints(d.get("old_batch_sizes")),
        new_batch_sizes=_ints(d.get("new_batch_sizes")),
    )


def read_run_log(path: str | os.PathLike[str]) -> RunLog:
    """Parse a run log; unknown keys and events are ignored, a truncated last line is skipped.

    Raises:
        ValidationError: the file is missing, or a line other than the last is not a JSON object.
    """
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValidationError(f"run log not found: {p}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValidationError(f"cannot read run log {p}: {e}") from None
    events: list[tuple[int, dict[str, Any]]] = []
    skipped = 0
    numbered = [(i + 1, s) for i, s in enumerate(lines) if s.strip()]
    for k, (lineno, text) in enumerate(numbered):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            if k == len(numbered) - 1:
                skipped += 1  # a run killed mid-write leaves half a line; everything before it is good
                continue
            raise ValidationError(f"{p}:{lineno}: not a JSON line ({e.msg}); is this a `planner train --log` file?") from None
        if not isinstance(obj, dict):
            raise ValidationError(f"{p}:{lineno}: expected a JSON object per line, got {type(obj).__name__}")
        events.append((lineno, obj))
    world_size = global_batch = None
    start_plan = None
    epochs: list[EpochRecord] = []
    replans: list[ReplanRecord] = []
    for lineno, ev in events:
        kind = ev.get("event")
        if kind == "start":
            world_size = ev.get("world_size") if isinstance(ev.get("world_size"), int) else None
            global_batch = ev.get("global_batch") if isinstance(ev.get("global_batch"), int) else None
            if isinstance(ev.get("plan"), dict):
                try:
                    start_plan = Plan.from_dict(ev["plan"], path=f"{p}:{lineno}.plan")
                except ValidationError:
                    start_plan = None  # the report still shows measured numbers without it
        elif kind == "epoch":
            epochs.append(_epoch(ev, f"{p}:{lineno}"))
        elif kind == "replan":
            replans.append(_replan(ev))
    if not epochs and not replans and world_size is None:
        raise ValidationError(f"{p}: no start, epoch or replan events; is this a `planner train --log` file?")
    return RunLog(
        world_size=world_size,
        global_batch=global_batch,
        start_plan=start_plan,
        epochs=tuple(epochs),
        replans=tuple(replans),
        num_skipped_lines=skipped,
    )
