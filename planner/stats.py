"""StepStats: what the runtime measured on one rank over one epoch (the re-planner's input, the log's rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.errors import ValidationError
from planner.jsonio import JSONDict, as_int, as_num, as_obj

LOADER_WAIT_FRAC = 0.10
"""Data wait above this fraction of the step: the rank's loader did not keep up and paced its steps (the rule of
``StepStats.busy_s``, the report's run-log table and the Replanner's loader correction)."""
WORKERS_KEPT_UP = 0.9
"""Workers whose own period (``StepStats.loader_period_s``) is at most this share of a rank's step kept up with it:
a data wait beyond ``LOADER_WAIT_FRAC`` is then the hand-over of each built batch to the loop (the pinning thread's
copy), not the workers -- the report's cause (reports.measured.handover_cause) and the Replanner's correction
(runtime.replan.model) read it alike."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    rank: int
    epoch: int
    num_steps: int
    batch_size: int
    num_workers: int
    data_wait_s: float
    """Mean seconds per step the training loop waited for its next batch (over the same steps as
    ``step_time_s``)."""
    compute_s: float
    """Mean seconds per step from forward start until the last gradient bucket was ready (no waiting for peers),
    over the steps that are not outliers (see ``num_outliers``)."""
    step_time_s: float
    """Mean wall seconds per step, synchronization included.  When the batches come from DataLoaders
    (`planner train`), the mean over the epoch's last whole cycles of the job's workers
    (runtime.timing.worker_cycle): workers deliver in bursts, and only whole cycles time their pace."""
    compute_s_std: float = 0.0
    """Standard deviation of compute_s across the steps averaged (the noise the re-planner must beat)."""
    compute_s_median: float | None = None
    """Median compute time per step over the valid steps not slowed by a late peer (robust to a few stalls)."""
    compute_s_mad: float | None = None
    """Median absolute deviation of the per-step compute times from their median (1.4826 x MAD estimates the
    standard deviation of the bulk of the steps, whatever the tail)."""
    step_time_s_std: float | None = None
    """Standard deviation of the per-step step time over every step averaged (stalls included): the noise of
    ``step_time_s``, which a revert compares between two epochs."""
    num_outliers: int = 0
    """Steps left out of ``compute_s`` because their compute time was more than 5 robust sigmas from the median
    (an epoch-start worker spin-up, GC, another process's burst); they are counted, not hidden."""

    num_peer_late: int = 0
    """Steps left out of ``compute_s`` because a peer waited for data in them (or the step before) longer than this
    rank: a late peer stretches this rank's compute span (runtime.timing), which is not this rank's own speed."""
    interference_s: float = 0.0
    """Mean seconds per step the peer-late steps added to the compute span (the mean over every step minus
    ``compute_s``): time lost to peers, shown beside the rank's own."""
    loader_s: float | None = None
    """Mean seconds per step the loader's workers spent building the step's batches, each worker's first batch
    left out (samples' fetch and transforms plus the collate, timed in the worker: runtime.loader_timing; some
    older logs hold the median); None when not measured (synthetic batches on the device, an adapter's own
    loader, an older log)."""

    fill_steps: int = 0
    """Steps at the epoch start (warm-up included) left out of ``step_time_s``, ``data_wait_s`` and ``loader_s``
    because the job's DataLoaders were filling their pipelines in them (runtime.timing: every worker builds its
    prefetch at once; the steps of the drain at the epoch's end are left out too); 0 when the epoch had no steady
    middle between fill and drain, and the means then cover them."""
    fill_excess_s: float = 0.0
    """Seconds those ``fill_steps`` took beyond the steady ``step_time_s``: what each epoch start costs."""
    drain_steps: int = 0
    """Steps of the epoch in which the job's DataLoaders had every batch of their pass handed out, so the workers
    fell idle and the GPU ran on batches built before (an epoch's end, or a stream's last epochs: a loader that runs
    across epochs drains only where the run ends, planner.cli.steps.StreamedEpochs).  Left out of the means when a
    steady part remains; when the whole epoch is drain (``drain_steps`` >= ``num_steps``) its means are the GPU's
    pace, not the loader's."""
    compile_steps: int = 0
    """Steps whose compute ran over ``runtime.timing.COMPILE_FACTOR`` times the epoch's median compute and at least
    ``COMPILE_MIN_S``: a compile (torch.compile at a shape the rank had not run: its first step, or the first at a
    new batch size after a re-plan).  Left out of every mean (warm-up steps among them are counted here too), so a
    recompile epoch is not read as a slow rank."""
    compile_s: float = 0.0
    """Seconds those ``compile_steps`` took beyond the epoch's median step: the compile time, kept apart from the
    step time (0 in older logs)."""

    def to_dict(self) -> JSONDict:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, data: Any, path: str = "stats") -> StepStats:
        d = as_obj(
            data,
            path,
            required=("rank", "epoch", "num_steps", "batch_size", "num_workers", "data_wait_s", "compute_s",
                      "step_time_s"),
            allowed=("compute_s_std", "compute_s_median", "compute_s_mad", "num_outliers", "step_time_s_std",
                     "num_peer_late", "interference_s", "loader_s", "fill_steps", "fill_excess_s", "drain_steps",
                     "compile_steps", "compile_s"),
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
            compute_s_median=_opt_num(d, "compute_s_median", path),
            compute_s_mad=_opt_num(d, "compute_s_mad", path),
            num_outliers=as_int(d.get("num_outliers", 0), f"{path}.num_outliers", min_value=0),
            step_time_s_std=_opt_num(d, "step_time_s_std", path),
            num_peer_late=as_int(d.get("num_peer_late", 0), f"{path}.num_peer_late", min_value=0),
            interference_s=as_num(d.get("interference_s", 0.0), f"{path}.interference_s", non_negative=True),
            loader_s=_opt_num(d, "loader_s", path),
            fill_steps=as_int(d.get("fill_steps", 0), f"{path}.fill_steps", min_value=0),
            fill_excess_s=as_num(d.get("fill_excess_s", 0.0), f"{path}.fill_excess_s", non_negative=True),
            drain_steps=as_int(d.get("drain_steps", 0), f"{path}.drain_steps", min_value=0),
            compile_steps=as_int(d.get("compile_steps", 0), f"{path}.compile_steps", min_value=0),
            compile_s=as_num(d.get("compile_s", 0.0), f"{path}.compile_s", non_negative=True),
        )

    @property
    def loader_paced(self) -> bool:
        """Whether the loader paced this rank (data wait above ``LOADER_WAIT_FRAC`` of the step)."""
        return self.step_time_s > 0 and self.data_wait_s > LOADER_WAIT_FRAC * self.step_time_s

    @property
    def loader_period_s(self) -> float | None:
        """Seconds per step the loader needs on its own: ``loader_s`` over the workers building batches in
        parallel (the loop itself with 0 workers); None when not measured."""
        if self.loader_s is None:
            return None
        return self.loader_s / max(1, self.num_workers)

    @property
    def busy_s(self) -> float:
        """This rank's own time per step, the counterpart of the plan's per-rank step time: compute + data wait,
        or the whole step when the loader paced the rank -- its workers keep loading through the all-reduce and
        optimizer tail after the last bucket, so the loader's period is the step (2x H100, ResNet-50: compute
        92 + wait 52 = 144 ms of a 179 ms step whose 341 samples the 8 workers delivered at 1.9k samples/s).
        Where the workers' build time was measured, never less than the loader's own period: a loader that keeps
        up only because a late peer paces the step still costs its time (2x H200, rank capped at 2 workers: 31 ms
        of compute, no wait, and ~190 ms of loading per step by the host's measured per-worker rate).  Never more
        than the step itself by way of the loader: it cannot need longer per step than the steps it fed took."""
        own = self.step_time_s if self.loader_paced else self.compute_s + self.data_wait_s
        period = self.loader_period_s
        return own if period is None else max(own, min(period, self.step_time_s))

    @property
    def compute_s_sigma(self) -> float:
        """The per-step noise of compute_s: the robust 1.4826 x MAD when recorded, else the standard deviation."""
        if self.compute_s_mad:
            return 1.4826 * self.compute_s_mad
        return self.compute_s_std


def _opt_num(d: Any, key: str, path: str) -> float | None:
    v = d.get(key)
    return None if v is None else as_num(v, f"{path}.{key}", non_negative=True)


DIAGNOSIS_CAUSES = ("loader", "cpu-cotenant", "memory", "gpu-cotenant", "clocks", "late-peer", "inside-step",
                    "device-other")
"""What runtime.diagnose names a rank's slowness after (``Diagnosis.cause``): its loader paced it; other processes'
CPU (or a hypervisor's steal) on its cores; host memory nearly full; other processes on its GPU; its clocks low or
throttled; a late peer stretched its steps; nothing NVML/psutil measured explains it (the cost is inside its
training step); another device fact (PCIe link, NUMA, MIG/MPS, an emulated slowdown)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Diagnosis:
    """One rank measured slower than the plan in force predicted for it, beyond the epoch's noise, and why
    (runtime.diagnose; the run log's ``diagnosis`` list of an epoch record)."""

    rank: int
    cause: str
    """One of ``DIAGNOSIS_CAUSES``."""
    measured_s: float
    """The rank's own time per step (``StepStats.busy_s``)."""
    predicted_s: float
    """The plan's per-rank prediction for it (``RankPlan.timer_busy_s``)."""
    evidence: str = ""
    """The measured facts behind the cause, in words with their numbers."""

    @property
    def error(self) -> float:
        """measured / predicted - 1 (0.5 = 50% slower than predicted)."""
        return self.measured_s / self.predicted_s - 1 if self.predicted_s > 0 else float("inf")

    def to_dict(self) -> JSONDict:
        return {"rank": self.rank, "cause": self.cause, "measured_s": self.measured_s,
                "predicted_s": self.predicted_s, "evidence": self.evidence}

    @classmethod
    def from_dict(cls, data: Any, path: str = "diagnosis") -> Diagnosis:
        d = as_obj(data, path, required=("rank", "cause", "measured_s", "predicted_s"), allowed=("evidence",))
        cause = d["cause"]
        if not isinstance(cause, str) or len(cause) > 64:
            raise ValidationError(f"{path}.cause must be a short string, got {str(cause)[:40]!r}")
        evidence = d.get("evidence", "")
        return cls(rank=as_int(d["rank"], f"{path}.rank", min_value=0), cause=cause,
                   measured_s=as_num(d["measured_s"], f"{path}.measured_s", non_negative=True),
                   predicted_s=as_num(d["predicted_s"], f"{path}.predicted_s", non_negative=True),
                   evidence=str(evidence)[:2000] if evidence is not None else "")
