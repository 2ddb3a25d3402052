"""Atomic checkpoints: model, optimizer, sampler position, plan and re-plan state in one file.

Written by rank 0 to ``DIR/checkpoint.pt`` through a temp file and ``os.replace``, so a kill -9 at any moment
leaves either the previous checkpoint or the new one, never a torn file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from planner.errors import ValidationError
from planner.plan import Plan

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_VERSION = 1


def save_checkpoint(directory: str | os.PathLike[str], *, epoch: int, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, plan: Plan, sampler_state: dict[str, Any] | None,
                    replanner: Any = None) -> Path:
    """Save where training resumes: `epoch` and `step` are the next step to run."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {
        "version": CHECKPOINT_VERSION,
        "epoch": epoch,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "plan": plan.to_dict(),
        "sampler": sampler_state,
        "replanner": replanner.state_dict() if replanner is not None else None,
    }
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint.", suffix=".tmp", dir=d)
    os.close(fd)
    try:
        torch.save(state, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        target = d / CHECKPOINT_NAME
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return target


def load_checkpoint(directory: str | os.PathLike[str], device: torch.device) -> dict[str, Any] | None:
    """The saved state, or None when the folder holds no checkpoint yet (a fresh start)."""
    path = Path(directory) / CHECKPOINT_NAME
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # unpickling raises many types (UnpicklingError, EOFError, RuntimeError, ...)
        # Our own writes are atomic, so this is a file from elsewhere or a damaged disk: say so, no traceback.
        why = (str(e).strip().splitlines() or [""])[0]  # the CLI prints one line
        raise ValidationError(f"{path}: not a readable checkpoint ({type(e).__name__}: {why}); delete it to start "
                              "afresh or point --checkpoint at the folder of the run to resume") from None
    version = state.get("version") if isinstance(state, dict) else None
    if version != CHECKPOINT_VERSION:
        raise ValidationError(f"{path}: checkpoint version {version} is not {CHECKPOINT_VERSION}")
    return state


def saved_global_batch(directory: str | os.PathLike[str]) -> int | None:
    """The global batch of the run that wrote the checkpoint in `directory` (None when there is none yet)."""
    state = load_checkpoint(directory, torch.device("cpu"))
    return None if state is None else int(Plan.from_dict(state["plan"]).global_batch)
