"""What the framework tests share: float64 data and model, the single-process reference, plans, the launcher.

The reference is the definition of exactness: global step s of epoch 0 covers P[s*B:(s+1)*B] of the epoch's
permutation (runtime.sampler.epoch_permutation(N, seed)) whatever the split, so one process training on exactly
those samples -- mean loss over all of them, the same optimizer -- is what a 2-rank run must reproduce.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
IN_FEATURES = 8
LR, MOMENTUM = 0.1, 0.9


class DictData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """float64 samples {"x": 8 features, "y": 1 target}: a batch is a dict, not (x, y)."""

    def __init__(self, n: int, features: int = IN_FEATURES) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, features, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 1, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()


def dict_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["x"]), batch["y"])


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def reference_params(n: int, windows: Sequence[int], seed: int = 0) -> list[torch.Tensor]:
    """One process, epoch 0: optimizer step k on the next ``windows[k]`` samples of the epoch's permutation."""
    from runtime.sampler import epoch_permutation

    data, model = DictData(n), make_net()
    opt = make_optimizer(model)
    perm = epoch_permutation(n, seed).tolist()
    start = 0
    for size in windows:
        idx = perm[start:start + size]
        start += size
        opt.zero_grad()
        dict_loss(model, {"x": data.x[idx], "y": data.y[idx]}).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def write_plan(path: Path, batches: list[int], sec_per_sample: list[float] | None = None) -> Path:
    """A plan with these batches (0 loader workers) from a linear profile; the profile beside it."""
    import planner
    from tests.planner._profiles import linear_profile

    profile = linear_profile(sec_per_sample or [1e-3] * len(batches))
    planner.evaluate(profile, batches, num_workers=[0] * len(batches)).save(path)
    profile.save(path.with_suffix(".profile.json"))
    return path


def torchrun(script: Path, args: list[str], *, timeout_s: float, nproc: int = 2) -> tuple[int, str, str]:
    """The script on ``nproc`` gloo ranks with torchrun's environment (tests/_ranks.py: forks of the tests' fork
    server, no interpreter start); every rank killed past the deadline."""
    from tests import _ranks

    rc, out, err, _ = _ranks.run([str(script), *args], nproc=nproc, timeout_s=timeout_s)
    return rc, out, err


def run_scenarios(script: Path, out: Path) -> Path:
    """Run a framework's scenarios script once on 2 gloo ranks with a [7, 3] and an [8, 8] plan written into
    ``out`` (the module-scoped fixture of tests/frameworks/test_<framework>.py); its results land in ``out``."""
    plan73 = write_plan(out / "plan73.json", [7, 3])
    plan88 = write_plan(out / "plan88.json", [8, 8])
    rc, _, err = torchrun(script, [str(out), str(plan73), str(plan88)], timeout_s=240)
    assert rc == 0, err[-4000:]
    return out


def load_result(out: Path, name: str) -> Any:
    """What a scenarios script saved as ``name`` (save_rank0)."""
    return torch.load(out / f"{name}.pt", weights_only=True)


def in_repo() -> None:
    """Make the repository importable in a script torchrun started (as tests/reliability/_launch.py does)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def save_rank0(out: Path, name: str, obj: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(obj, out / f"{name}.pt")


def exit_without_teardown() -> None:
    """End a torchrun-launched test script once its results are saved: every rank leaves the group together, then
    the process exits without interpreter teardown, where gloo's threads can abort a finished rank ("terminate
    called without an active exception", seen under load) -- as tests/_dist.py and the CLI do."""
    import os
    import sys

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
