"""StepStats: what the runtime measured on one rank over one epoch (the re-planner's input, the log's rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.jsonio import JSONDict, as_int, as_num, as_obj


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    rank: int
    epoch: int
    num_steps: int
    batch_size: int
    num_workers: int
    data_wait_s: float
    """Mean seconds per step the training loop waited for its next batch."""
    compute_s: float
    """Mean seconds per step from forward start until the last gradient bucket was ready (no waiting for peers)."""
    step_time_s: float
    """Mean wall seconds per step, synchronization included."""
    compute_s_std: float = 0.0
    """Standard deviation of compute_s across steps (the noise the re-planner must beat)."""

    def to_dict(self) -> JSONDict:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: Any, path: str = "stats") -> StepStats:
        d = as_obj(
            data,
            path,
            required=("rank", "epoch", "num_steps", "batch_size", "num_workers", "data_wait_s", "compute_s",
                      "step_time_s"),
            allowed=("compute_s_std",),
        )
        return cls(
            rank=as_int(d["rank"], f"{path}.rank", min_value=0),
            epoch=as_int(d["epoch"], f"{path}.epoch", min_value=0),
            num_steps=as_int(d["num_steps"], f"{path}.num_steps", min_value=0),
            batch_size=as_int(d["batch_size"], f"{path}.batch_size", min_value=0),
            num_workers=as_int(d["num_workers"], f"{path}.num_workers", min_value=0),
            data_wait_s=as_num(d["data_wait_s"], f"{path}.data_wait_s", non_negative=True),
            compute_s=as_num(d["compute_s"], f"{path}.compute_s", non_negative=True),
            step_time_s=as_num(d["step_time_s"], f"{path}.step_time_s", non_negative=True),
            compute_s_std=as_num(d.get("compute_s_std", 0.0), f"{path}.compute_s_std", non_negative=True),
        )
