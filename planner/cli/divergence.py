"""A diverged loss is an outcome, not a crash: watch for it without a per-step synchronization, never checkpoint
over the last finite state, and say in one line where it happened and what was kept.

Unwatched, ``--lr 1e30`` would train on in NaN and write the NaN weights over the last good checkpoint.  So the
run log writes null for non-finite numbers, and the first step whose loss is not finite is tracked on the device
(a ``torch.where`` per step, read only where the loop synchronizes anyway: at a checkpoint and at the epoch end); a mid-epoch checkpoint after it is skipped; at the
epoch end every rank sees every rank's first bad step in the gathered stats and all stop together (exit 2),
after the run log got the epoch (loss null) and an end record with the reason.
"""

from __future__ import annotations

import torch

from planner.argcheck import ALLOW_RESUME_FLAG
from planner.errors import ValidationError


def weights_finite(model: torch.nn.Module) -> bool:
    """Every parameter finite (a NaN gradient from any rank reaches every rank's weights through the all-reduce)."""
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


class DivergenceWatch:
    """The first global step of an epoch whose loss was not finite (-1: none yet), kept on the device."""

    def __init__(self, device: torch.device) -> None:
        self._bad = torch.full((), -1, device=device, dtype=torch.int64)

    def observe(self, loss: torch.Tensor, step: int) -> None:
        self._bad = torch.where((self._bad < 0) & ~torch.isfinite(loss.detach()), step, self._bad)

    def first_bad(self) -> int:
        """The step, or -1 (synchronizes with the device)."""
        return int(self._bad.item())

    def clean(self, model: torch.nn.Module) -> bool:
        """Nothing diverged so far: the state may be saved."""
        return self.first_bad() < 0 and weights_finite(model)

    def at_epoch_end(self, model: torch.nn.Module, first_step: int, next_step: int) -> int:
        """This rank's first bad step of the epoch: the loss's, or the last step when only the weights of its final
        update went non-finite (the loss of that update was computed before it); -1 when clean."""
        bad = self.first_bad()
        if bad < 0 and next_step > first_step and not weights_finite(model):
            bad = next_step - 1
        return bad


def divergence_error(reason: str, *, lr: float, checkpoint_dir: str | None,
                     last_saved: tuple[int, int] | None) -> ValidationError:
    """The one line every rank raises: where it diverged, and which checkpoint holds the last finite state."""
    if not checkpoint_dir:
        kept = "no --checkpoint was given"
    elif last_saved is None:
        kept = f"no checkpoint was written before it ({checkpoint_dir} holds none from this run)"
    else:
        kept = (f"{checkpoint_dir} keeps the last finite state (epoch {last_saved[0]} step {last_saved[1]}): resume "
                f"it with a smaller --lr and {ALLOW_RESUME_FLAG}")
    return ValidationError(f"{reason} (--lr {lr:g}); the run stopped and {kept}")


__all__ = ["DivergenceWatch", "divergence_error", "weights_finite"]
