"""Emulated heterogeneity: one module used identically by `planner profile` and `planner train`.

Our machines have identical cards, so compute skew is produced on purpose (DESIGN.md section 7a):

``Slowdown(factor)`` makes a rank's training step take about ``factor`` times its real compute by repeating
real work.  Each step, before (or after) the real forward/backward, ``apply`` runs

  * ``floor(factor - 1)`` extra forward+backward passes on the whole batch, and
  * one extra pass on the first ``round(frac * b)`` samples of the batch for the fractional part
    ``frac = factor - 1 - floor(factor - 1)``.

Every extra pass runs on the *unwrapped* module and takes its gradients with ``torch.autograd.grad(loss,
params)``, so nothing reaches ``.grad`` nor DDP's reducer (DDP only sees the real pass).  BatchNorm running
statistics are left untouched (momentum set to 0 during the extra passes, ``num_batches_tracked`` restored), so
an emulated rank trains exactly like a real one.  The passes run inside whatever ``torch.autocast`` context the
caller is in, so bf16/fp16 steps are slowed by the same kind of work.

Why repeated work rather than a calibrated stall (sleep): a sleep releases the device and the CPU, so it neither
loads the GPU like a slower card nor shows up in CUDA-event timing of backward; repeated passes do, scale with
the batch size exactly like the real step (the curve's shape is kept, t(b) -> f * t(b)), and need no calibration
that could drift.  The fractional slice is proportional only where t(b) is linear in b; on a GPU in its flat
region (tiny batches) a half-batch pass costs nearly a full one, so the fractional part over-slows there.
Integer factors are exact in work.  Measured on H100 (ResNet-50, bf16): factor 3 gave 3.01-3.03x the rank's own
fwd+bwd time at batch 48-432; on CPU see tests/profiler/test_emulate.py.  The optimizer step is not repeated, so
a full step is slowed by slightly less than ``factor`` (by the optimizer's share of the step).

``--emulate-loader RANK=W`` caps a rank's dataloader workers; the trainer applies the cap and the profiler
records it (``RankProfile.meta["emulate_loader_workers"]``) and measures loader scaling only up to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import ValidationError

if TYPE_CHECKING:
    import torch


def _parse_rank_pairs(text: str, flag: str, value_form: str) -> dict[int, str]:
    out: dict[int, str] = {}
    form = f"expected RANK={value_form}[,RANK={value_form}..], e.g. {flag} 1=3,2=1.5"
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep or not key.strip().isdigit() or not val.strip():
            raise ValidationError(f"{flag}: cannot read {part!r}; {form}")
        rank = int(key)
        if rank in out:
            raise ValidationError(f"{flag}: rank {rank} given twice in {text!r}; {form}")
        out[rank] = val.strip()
    return out


def parse_rank_floats(text: str | None, *, flag: str = "--emulate-slowdown") -> dict[int, float]:
    """Parse ``"1=3,2=1.5"`` into ``{1: 3.0, 2: 1.5}``; every factor must be >= 1.

    Raises:
        ValidationError: malformed text or a factor below 1, with the expected form.
    """
    if not text:
        return {}
    out: dict[int, float] = {}
    for rank, val in _parse_rank_pairs(text, flag, "FACTOR").items():
        try:
            f = float(val)
        except ValueError:
            raise ValidationError(f"{flag}: factor {val!r} for rank {rank} is not a number; e.g. {flag} 1=3") from None
        if not math.isfinite(f) or f < 1.0:
            raise ValidationError(f"{flag}: factor for rank {rank} must be >= 1 (1 = real speed), got {val}")
        out[rank] = f
    return out


def parse_rank_gib(text: str | None, *, flag: str = "--emulate-memory") -> dict[int, float]:
    """Parse ``"0=20,1=40"`` into ``{0: 20.0, 1: 40.0}`` GiB of device memory per rank (each > 0).

    Raises:
        ValidationError: malformed text or a size that is not a positive number.
    """
    if not text:
        return {}
    out: dict[int, float] = {}
    for rank, val in _parse_rank_pairs(text, flag, "GIB").items():
        try:
            gib = float(val)
        except ValueError:
            raise ValidationError(f"{flag}: {val!r} for rank {rank} is not a number of GiB; e.g. {flag} 0=20") from None
        if not math.isfinite(gib) or gib <= 0:
            raise ValidationError(f"{flag}: memory for rank {rank} must be > 0 GiB, got {val}")
        out[rank] = gib
    return out


def cap_device_memory(device: torch.device, gib: float | None, *, flag: str = "--emulate-memory") -> float | None:
    """Emulate a smaller GPU: let this process allocate at most ``gib`` GiB on ``device``
    (``torch.cuda.set_per_process_memory_fraction``), so a batch that does not fit raises a real out-of-memory
    error in the profiler's sweep and in training alike.  Returns the fraction set (None when ``gib`` is None).
    """
    import torch

    if gib is None:
        return None
    if device.type != "cuda":
        raise ValidationError(f"{flag}: emulated memory needs a CUDA device, this rank runs on {device}")
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = gib * 2**30 / total
    if not 0 < fraction < 1:
        raise ValidationError(f"{flag}: {gib:g} GiB is not below this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def parse_rank_ints(text: str | None, *, flag: str = "--emulate-loader") -> dict[int, int]:
    """Parse ``"1=2,3=0"`` into ``{1: 2, 3: 0}`` (worker counts, each >= 0).

    Raises:
        ValidationError: malformed text or a negative count, with the expected form.
    """
    if not text:
        return {}
    out: dict[int, int] = {}
    for rank, val in _parse_rank_pairs(text, flag, "WORKERS").items():
        if not val.isdigit():
            raise ValidationError(f"{flag}: worker count {val!r} for rank {rank} must be an integer >= 0; e.g. {flag} 1=2")
        out[rank] = int(val)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowdownPlan:
    """How a factor is turned into work: full extra passes plus one pass on a slice of the batch."""

    full_passes: int
    slice_samples: int
    """Samples in the fractional pass (0: none)."""


@dataclass(frozen=True, slots=True)
class Slowdown:
    """Run about ``factor`` times the real forward+backward work per step (see the module docstring).

    Call ``apply(module, loss_fn, x, y)`` once per training step, inside the same autocast context as the real
    forward.  ``factor == 1`` is a no-op.
    """

    factor: float = 1.0
    """Target step-time multiplier (>= 1)."""

    def __post_init__(self) -> None:
        if not math.isfinite(self.factor) or self.factor < 1.0:
            raise ValidationError(f"slowdown factor must be >= 1 (1 = real speed), got {self.factor}")

    @property
    def enabled(self) -> bool:
        return self.factor > 1.0

    def plan(self, batch_size: int) -> SlowdownPlan:
        extra = self.factor - 1.0
        full = math.floor(extra + 1e-9)
        frac = max(0.0, extra - full)
        return SlowdownPlan(full_passes=full, slice_samples=min(batch_size, round(frac * batch_size)))

    def apply(self, module: torch.nn.Module, loss_fn: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> None:
        """Do the extra passes; gradients are computed and dropped, model state is left as it was."""
        if not self.enabled:
            return
        # DDP's forward would touch its reducer; the wrapped module never does.
        inner = getattr(module, "module", module) if _is_ddp(module) else module
        params = [p for p in inner.parameters() if p.requires_grad]
        work = self.plan(int(x.shape[0]))
        with _frozen_batchnorm(inner):
            for _ in range(work.full_passes):
                _extra_pass(inner, loss_fn, x, y, params)
            if work.slice_samples > 0:
                _extra_pass(inner, loss_fn, x[: work.slice_samples], y[: work.slice_samples], params)


def _extra_pass(module: Any, loss_fn: Callable[..., Any], x: Any, y: Any, params: list[Any]) -> None:
    import torch

    loss = loss_fn(module(x), y)
    # allow_unused: a parameter outside this forward (e.g. an unused head) must not raise.
    torch.autograd.grad(loss, params, allow_unused=True)


def _is_ddp(module: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(module, DistributedDataParallel)


class _frozen_batchnorm:
    """Context: BatchNorm layers normalize with batch statistics but do not update running stats."""

    def __init__(self, module: Any) -> None:
        from torch.nn.modules.batchnorm import _BatchNorm

        self._saved: list[tuple[Any, Any, Any]] = []
        for m in module.modules():
            if isinstance(m, _BatchNorm) and m.training and m.track_running_stats:
                nbt = None if m.num_batches_tracked is None else m.num_batches_tracked.clone()
                self._saved.append((m, m.momentum, nbt))

    def __enter__(self) -> None:
        # momentum 0: running = (1 - 0) * running + 0 * batch_stat, i.e. unchanged.
        for m, _, _ in self._saved:
            m.momentum = 0.0

    def __exit__(self, *exc: object) -> None:
        for m, momentum, nbt in self._saved:
            m.momentum = momentum
            if nbt is not None:
                m.num_batches_tracked.copy_(nbt)
