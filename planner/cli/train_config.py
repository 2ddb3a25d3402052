"""What `planner train` runs and what one epoch gives back: ``TrainConfig`` (checked on construction) and
``EpochResult`` (planner.cli.train uses both; `planner bench` builds its strategies from TrainConfig)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from planner.errors import ValidationError
from planner.profile import GRAD_COMPRESSIONS
from runtime.ddp_settings import DDP_SETTINGS, ddp_settings_from  # noqa: F401  (re-exported: one check for train and the runtime)

STRATEGIES = ("plan", "equal")
WEIGHTINGS = ("loss_scale", "hook")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    model: str = "mlp"
    dataset: str = "fake"
    image_size: int | None = None
    num_samples: int | None = None
    """Length of the fake dataset (default: the spec's)."""
    epochs: int = 2
    max_steps_per_epoch: int | None = None
    """Stop each epoch after this many steps (benchmarks; breaks exactly-once coverage on purpose)."""
    lr: float = 0.01
    amp: bool = False
    seed: int = 0
    replan: bool = False
    replan_threshold: float = 0.05
    replan_smoothing: float | None = None
    """EMA weight of the newest epoch in the re-planner's model (None: the Replanner's documented default)."""
    strategy: str = "plan"
    """'plan' (HeteroBatchSampler + exact weighting) or 'equal' (torch DistributedSampler + plain DDP)."""
    weighting: str = "loss_scale"
    """How 'plan' weights uneven batches exactly: 'loss_scale' (the mean loss times n_i * W / n through DDP's own
    C++ all-reduce; also exact with SyncBatchNorm) or 'hook' (``register_weighted_hook``, a Python comm hook).
    Same parameters to 1e-10 (tests/cli/test_train_weighting.py); its cost is measured by
    benchmarks/comm_breakdown.py --overhead."""
    grad_compress: str = "none"
    """Wire dtype of the gradient all-reduce: 'none' (the parameters' dtype, exact), or opt-in 'bf16'/'fp16'
    (runtime/compress.py: scaled by n_i / n in fp32, then cast and summed). With 'plan' it runs in the weighting
    hook whatever ``weighting`` says (the loss scale would cast before scaling); with 'equal', torch's own
    compress hook."""
    fsdp: bool = False
    """Shard the model with FSDP2 (``fully_shard`` per top-level block, then the root) instead of DDP; the plan's
    micro-batches run with ``set_requires_gradient_sync`` on the last one (every rank the same count)."""
    data_on_device: bool = False
    """Skip the DataLoader: synthetic inputs made on the device (isolates compute skew; the loader is not run)."""
    slowdown: float = 1.0
    """Emulated compute factor of this rank (profiler.workloads.emulate.Slowdown), applied from the first epoch."""
    slowdown_late: float | None = None
    """If set, the factor used from epoch `slowdown_from_epoch` on (a mid-run slowdown)."""
    slowdown_from_epoch: int = 0
    loader_workers_cap: int | None = None
    log_path: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Also checkpoint every N steps inside an epoch (0: only at epoch ends)."""
    resume: bool = False
    resume_changes: tuple[str, ...] = ()
    """On resume, what this run takes from its config instead of the checkpoint ('lr', 'plan'): changes the user
    allowed with --allow-resume-changes (planner/cli/preflight.py compared them)."""
    quiet: bool = False
    mixed_devices: bool = False
    """Some ranks are CPU and some CUDA (gloo): keep one memory format everywhere (no channels_last)."""
    trace_path: str | None = None
    """Write every (epoch, step, rank, indices) to this file (tests of resume; one file per rank)."""
    step_log_path: str | None = None
    """Append one JSON line per epoch with this rank's every step (data wait, compute, step, build seconds)."""
    loader_check_s: float | None = None
    """``--auto``: seconds every rank runs its plan's DataLoader at once before training, to scale the profile's
    loader curves to what they measured and solve again (planner.cli.loader_check; 0: no check; None: 3 s, 1 s with
    ``--quick``); ``--loader-check-s``."""
    gpu_normalize: bool = False
    """The built-in image datasets hand over uint8 images, normalized on the device (Workload.normalize): a
    quarter of the bytes through shared memory, the pin thread and the host-to-device copy."""
    restart_loader_each_epoch: bool = False
    """A new DataLoader pass per epoch, as ``for batch in loader`` does, instead of one that runs across epoch
    boundaries (planner.cli.steps.StreamedEpochs, the default for the planned sampler): the stock behaviour, to compare."""

    AGREED = ("model", "dataset", "image_size", "num_samples", "epochs", "max_steps_per_epoch", "lr", "amp",
              "replan", "replan_threshold", "replan_smoothing", "strategy", "weighting", "grad_compress", "fsdp",
              "data_on_device", "checkpoint_every", "resume", "gpu_normalize", "restart_loader_each_epoch")
    """The settings every rank must share (runtime.safety.check_agreement): they decide the model, the data, the
    number of steps and collectives, and the update.  The rest may differ by rank (emulated slowdowns, loader caps,
    per-rank log paths, progress output)."""

    def agreed_settings(self) -> dict[str, Any]:
        """``{"--lr": 0.01, ...}``: the values of ``AGREED`` by the flag that sets them, for the agreement check."""
        return {"--" + name.replace("_", "-"): getattr(self, name) for name in self.AGREED}

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValidationError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.weighting not in WEIGHTINGS:
            raise ValidationError(f"weighting must be 'loss_scale' or 'hook', got {self.weighting!r}")
        for name, low in (("epochs", 1), ("num_samples", 1), ("max_steps_per_epoch", 1), ("checkpoint_every", 0),
                          ("slowdown_from_epoch", 0), ("loader_workers_cap", 0), ("image_size", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValidationError(f"{name} must be >= {low}, got {value}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValidationError(f"lr must be a positive finite number, got {self.lr}")
        for name in ("slowdown", "slowdown_late"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 1.0):
                raise ValidationError(f"{name} must be a finite factor >= 1, got {value}")
        if not self.replan_threshold >= 0:
            raise ValidationError(f"replan_threshold must be >= 0, got {self.replan_threshold}")
        if self.grad_compress not in GRAD_COMPRESSIONS:
            raise ValidationError(f"grad_compress must be one of {', '.join(GRAD_COMPRESSIONS)}, got "
                                  f"{self.grad_compress!r}")
        if self.fsdp and self.grad_compress != "none":
            raise ValidationError("FSDP2 has no DDP comm hook to compress in: drop --grad-compress with --fsdp")
        if self.fsdp and self.weighting == "hook":
            raise ValidationError("FSDP2 has no DDP comm hook: use the loss-scale weighting (the default) with --fsdp")
        if self.fsdp and (self.checkpoint_dir or self.resume):
            raise ValidationError("--fsdp does not checkpoint yet (sharded state); drop --checkpoint/--resume")
        if self.resume and not self.checkpoint_dir:
            raise ValidationError("resume needs a checkpoint folder (--checkpoint DIR)")


@dataclass(kw_only=True, slots=True)
class EpochResult:
    epoch: int
    samples_per_s: float
    step_time_s: float
    loss: float
    batch_sizes: tuple[int, ...]
    stats: list[dict[str, Any]] = field(default_factory=list)
    device_states: list[dict[str, Any] | None] = field(default_factory=list)
    """Every rank's DeviceState at this epoch's end (JSON form), for the run log."""
    predicted_step_time_s: float = 0.0
    replan: dict[str, Any] | None = None
    wall_s: float | None = None
    """Wall seconds of the epoch's loop (the first batch's wait included), the slowest rank's."""
    samples: int = 0
    """Samples the epoch trained, all ranks together."""
    diverged_step: int | None = None
    """First global step of this epoch whose loss (or the weights after it) was not finite, on any rank."""
    unsteady: str | None = None
    """Why the epoch's times cannot judge a re-plan (``runtime.epoch.unsteady_start``: a loader stream's refill after a
    re-plan, or the run's first fill, with no steady window after it); None when they can."""
    end: Any = None
    """The runtime object's view of the epoch (``runtime.epoch.EpochEnd``), which its ``conclude`` decides on."""

