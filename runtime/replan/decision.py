"""ReplanDecision: what the re-planner decided at one epoch boundary, its log record and its wire form."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan
from planner.runlog import ReplanRecord

FAILED = "re-plan failed, keeping the plan: "
"""How a failed re-plan's ``warning`` (and reason) begins; the rest is "<Type>: <message>"."""
LINE_CHARS = 200
"""``ReplanDecision.line`` stays within this many characters (the run log keeps the whole reason)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplanDecision:
    """What the re-planner decided at one epoch boundary (identical on every rank after ``Replanner.step``)."""

    epoch: int
    adopted: bool
    reason: str
    """Why the plan was or was not changed, with the numbers."""
    old_plan: Plan
    """The plan that ran this epoch."""
    new_plan: Plan | None
    """The plan for the next epoch when adopted, else None."""
    predicted_gain: float | None
    """T(old plan) / T(new plan) - 1 under the updated model; None when no re-solve was made."""
    measured_compute_s: tuple[float, ...]
    """Per rank: mean compute time measured this epoch."""
    predicted_compute_s: tuple[float, ...]
    """Per rank: the model's compute time at the batch the rank ran, before this epoch's update."""
    candidate: Plan | None = None
    """The re-solved plan, also when it was not adopted."""
    scale_factors: tuple[float, ...] = ()
    """Per rank: compute time relative to the original profile after this update."""
    reverted: bool = False
    """The plan adopted at an earlier epoch measured slower than its predecessor, which comes back now."""
    repredicted: Plan | None = None
    """Not adopted, and the running plan missed its prediction: the same plan (batches, workers, fingerprint) with
    its predictions re-made under the updated model, which the next epoch runs and logs against.  None otherwise."""
    warning: str | None = None
    """The re-plan failed and the plan was kept: ``re-plan failed, keeping the plan: <Type>: <message>``; None when
    the decision was made (whatever it decided)."""
    brief: str = ""
    """The reason in a few words, for ``line`` ("" -- a decision from an older rank 0 -- uses ``reason``)."""
    inputs: Mapping[str, Any] | None = None
    """Everything the decision read: ``{"state": the Replanner's state_dict() before it, "stats": [every rank's
    StepStats.to_dict()]}`` (benchmarks/replan_replay.py replays it); None where not known."""

    @property
    def plan(self) -> Plan:
        """The plan in force for the next epoch (with its predictions as the Replanner now makes them)."""
        if self.new_plan is not None:
            return self.new_plan
        return self.repredicted if self.repredicted is not None else self.old_plan

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.plan.batch_sizes

    def line(self) -> str:
        """The one line a training loop prints on rank 0 per epoch-end decision (under ``LINE_CHARS``; the full
        reason stays in the run log)::

            epoch 3: re-plan adopted [5, 5] -> [9, 1] (predicted 42.0% faster): rank 1 measured 3.00x its ...
            epoch 4: re-plan kept [9, 1]: [8, 2] predicted +1.2%: below the threshold 5.0%
            epoch 5: re-plan reverted [6, 4] -> [9, 1]: measured 12.0% slower
            epoch 6: re-plan failed, keeping [9, 1]: ValidationError: ...
        """
        old, new = list(self.old_plan.batch_sizes), list(self.plan.batch_sizes)
        why = self.brief or self.reason
        if self.warning is not None:
            text = f"epoch {self.epoch}: re-plan failed, keeping {old}: {self.warning.removeprefix(FAILED)}"
        elif self.reverted:
            text = f"epoch {self.epoch}: re-plan reverted {old} -> {new}: {why}"
        elif self.adopted:
            gain = "" if self.predicted_gain is None else f" (predicted {self.predicted_gain:.1%} faster)"
            text = f"epoch {self.epoch}: re-plan adopted {old} -> {new}{gain}" + (f": {why}" if why else "")
        else:
            text = f"epoch {self.epoch}: re-plan kept {old}: {why}"
        text = " ".join(text.split())  # one line, whatever an exception's message held
        return text if len(text) <= LINE_CHARS else text[:LINE_CHARS - 3] + "..."

    def to_record(self) -> ReplanRecord:
        """The run log's record of this decision (planner.runlog: a 'replan' or, for a revert, a 'revert' event)."""
        return ReplanRecord(epoch=self.epoch, adopted=self.adopted, reason=self.reason,
                            predicted_gain=self.predicted_gain, old_batch_sizes=self.old_plan.batch_sizes,
                            new_batch_sizes=self.plan.batch_sizes, measured_compute_s=self.measured_compute_s,
                            predicted_compute_s=self.predicted_compute_s,
                            plan=self.new_plan if self.new_plan is not None else self.repredicted,
                            event="revert" if self.reverted else "replan", inputs=self.inputs)

    def to_log(self) -> dict[str, Any]:
        """The JSON-lines record the report reads (non-finite numbers become null: the line stays valid JSON)."""
        return self.to_record().to_dict()

    def to_wire(self) -> dict[str, Any]:
        """What rank 0 sends the others (JSON-able): the log record plus what it leaves out."""
        return {"log": self.to_log(), "candidate": self.candidate.to_dict() if self.candidate is not None else None,
                "scale_factors": list(self.scale_factors),
                "repredicted": self.repredicted.to_dict() if self.repredicted is not None else None,
                "warning": self.warning, "brief": self.brief}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], old_plan: Plan) -> ReplanDecision:
        """The decision ``to_wire`` described, on a rank whose plan this epoch was ``old_plan`` (the same as rank
        0's: the fingerprints were compared before deciding)."""
        log, cand = wire["log"], wire["candidate"]
        return cls(
            epoch=int(log["epoch"]), adopted=bool(log["adopted"]), reason=str(log["reason"]), old_plan=old_plan,
            new_plan=Plan.from_dict(log["plan"], path="replan.plan") if log["plan"] is not None else None,
            predicted_gain=log["predicted_gain"],
            # The log wrote a NaN measurement as null; the decision holds it as NaN again, as on rank 0.
            measured_compute_s=_nan_for_none(log["measured_compute_s"]),
            predicted_compute_s=_nan_for_none(log["predicted_compute_s"]),
            candidate=Plan.from_dict(cand, path="replan.candidate") if cand is not None else None,
            scale_factors=tuple(float(x) for x in wire["scale_factors"]),
            reverted=log["event"] == "revert",
            repredicted=(Plan.from_dict(wire["repredicted"], path="replan.repredicted")
                         if wire.get("repredicted") is not None else None),
            warning=None if wire.get("warning") is None else str(wire["warning"]),
            brief=str(wire.get("brief") or ""),
            inputs=log.get("inputs"),
        )


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _nan_for_none(xs: list[float | None]) -> tuple[float, ...]:
    return tuple(math.nan if x is None else float(x) for x in xs)
