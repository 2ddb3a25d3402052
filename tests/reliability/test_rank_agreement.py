"""Every rank agrees, before its first step, on everything that decides its data or its collectives.

- resume: with node-local ``--checkpoint`` folders, rank 0's holding a checkpoint and rank 1's none, rank 0
  resumed at epoch 1 and rank 1 started fresh; together they missed and repeated samples, silently. Every rank now
  compares (resumed or not, epoch, step, the checkpoint file's digest) first: one line naming each rank's state,
  exit 2 on every rank. ``PlannedRun`` compares the position its sampler starts at, for a loop that resumes with
  ``run.sampler.load_state_dict``.
- ``train --auto``: the profiling options (``--loader-check-s``, ``--min-batch``, ``--quick``,
  ``--max-workers-per-rank``) are agreed before the first profile collective (another --loader-check-s left a rank
  in a collective its peers never joined, until a timeout).
- version: every agreement payload starts with the package version and its format, compared first, so ranks on
  other code fail with one line instead of a KeyError.

Function-level checks run on the tests' gloo harness (tests/_dist.py); the two `planner train` launches run on the
fork-server launcher (tests/_ranks.py), each rank given its own argv by tests/reliability/_launch.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, cast

import pytest
import torch

import planner
from planner.cli.autoplan import AutoPlanOptions, auto_plan
from planner.cli.checkpoint import save_checkpoint
from planner.cli.preflight import run_meta
from planner.cli.train_config import TrainConfig
from planner.errors import ValidationError
from planner.plan import Plan
from runtime.collectives import all_gather_json
from runtime.run import PlannedRun
from runtime.safety import AGREEMENT_FORMAT, check_agreement, check_settings
from runtime.sampler import HeteroBatchSampler
from tests import _ranks
from tests._dist import run_distributed
from tests.reliability import _fixtures
from tests.reliability.test_no_hangs import write_plan

FIX = "tests.reliability._fixtures"
LAUNCH = "tests/reliability/_launch.py"
DEADLINE_S = 60.0
GOOD = {"plan_fingerprint": "9f1c7a2b3d4e5f60", "dataset_len": 100, "seed": 0}


# -- the version and format lead every agreement -----------------------------------------------------------------
def version_worker(rank: int, world: int) -> None:
    mine = planner.__version__
    if rank == 1:
        planner.__version__ = "0.2.1"  # this process only: a host with another release installed
    try:
        with pytest.raises(ValidationError) as info:
            check_agreement(**GOOD)  # type: ignore[arg-type]
    finally:
        planner.__version__ = mine
    assert str(info.value) == (
        f"ranks run different ddp-planner versions: rank 0 has {mine} (agreement format {AGREEMENT_FORMAT}), "
        f"rank 1 has 0.2.1 (agreement format {AGREEMENT_FORMAT}); install the same ddp-planner version on every "
        f"host (pip install ddp-planner=={mine}), then relaunch"), str(info.value)
    # A rank of a version whose agreement named no version (its payload had other fields): one line, no KeyError.
    if rank == 1:
        all_gather_json({"world size": world, "plan fingerprint": GOOD["plan_fingerprint"], "dataset length": 100,
                         "seed": 0})
    else:
        with pytest.raises(ValidationError, match=r"rank 1 has an older version \(its agreement names none\)"):
            check_agreement(**GOOD)  # type: ignore[arg-type]


@pytest.mark.distributed
def test_ranks_on_other_versions_fail_with_one_line_naming_both() -> None:
    run_distributed(version_worker, 2, timeout_s=30)


# -- train --auto's options -----------------------------------------------------------------------------------
AUTO_CASES: list[tuple[dict[str, Any], str]] = [
    ({"min_batch": 2}, "ranks disagree on --min-batch: rank 0 has 1, rank 1 has 2; launch every rank with the same "
                       "--min-batch"),
    ({"quick": True}, "ranks disagree on --quick: rank 0 has False, rank 1 has True; "),
    ({"max_workers_per_rank": 3}, "ranks disagree on --max-workers-per-rank: rank 0 has None, rank 1 has 3; "),
]


def auto_options_worker(rank: int, world: int) -> None:
    cfg = TrainConfig(model=f"{FIX}:model", dataset=f"{FIX}:dataset", loader_check_s=0.0)
    for change, expected in AUTO_CASES:
        options = AutoPlanOptions(global_batch=12, **(change if rank == 1 else {}))
        with pytest.raises(ValidationError) as info:
            # The agreement is auto_plan's first collective: nothing of the workload or the environment is used
            # before it, so a rank that disagrees never reaches a profile collective.
            auto_plan(cfg, cast(Any, None), cast(Any, None), options)
        assert str(info.value).startswith(expected) and "\n" not in str(info.value), str(info.value)
    # Settings in the caller's order: the first that differs is named.
    with pytest.raises(ValidationError, match=r"^ranks disagree on --b: rank 0 has 0, rank 1 has 1; fix b$"):
        check_settings({"--b": rank, "--a": rank}, fixes={"--b": "fix b"})


@pytest.mark.distributed
def test_auto_options_that_differ_by_rank_are_one_line_before_profiling() -> None:
    run_distributed(auto_options_worker, 2, timeout_s=30)


@pytest.mark.distributed
def test_train_auto_with_another_loader_check_per_rank_fails_fast_on_every_rank(tmp_path: Path) -> None:
    args = [LAUNCH, "train", "--auto", "--global-batch", "12", "--device", "cpu", "--epochs", "1", "--model",
            f"{FIX}:model", "--dataset", f"{FIX}:dataset", "--quick", "--loader-check-s", "{rank}",
            "--plan-out", str(tmp_path / "plan.json")]
    codes, _, err, _ = _ranks.run_each(args, timeout_s=DEADLINE_S)  # it hung in a collective before
    expected = ("error: ranks disagree on --loader-check-s: rank 0 has 0.0, rank 1 has 1.0; launch every rank with "
                "the same --loader-check-s")
    assert err.count(expected) == 2 and err.count("error: ") == 2, err[-3000:]
    assert "Traceback" not in err and codes == [2, 2], (codes, err[-2000:])
    assert not (tmp_path / "plan.json").exists()  # stopped before profiling, so before any plan


# -- resume -------------------------------------------------------------------------------------------------------
def _checkpoint_for(plan_path: Path, folder: Path, epoch: int) -> None:
    """What rank 0 of a 2-rank `planner train --plan plan_path` saves at the end of epoch ``epoch - 1``."""
    plan = Plan.load(plan_path)
    torch.manual_seed(0)
    model = _fixtures.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sampler = HeteroBatchSampler.from_plan(plan, 0, _fixtures.DATASET_LEN, seed=0)
    sampler.set_epoch(epoch - 1)
    meta = run_meta(model=f"{FIX}:model", dataset=f"{FIX}:dataset", image_size=None, num_samples=None, seed=0,
                    lr=0.01, plan=plan)
    save_checkpoint(folder, epoch=epoch, step=0, model=model, optimizer=optimizer, plan=plan,
                    sampler_state=sampler.state_dict(0), run=meta)


@pytest.mark.distributed
def test_ranks_that_would_resume_differently_fail_on_every_rank_naming_both(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    _checkpoint_for(plan, tmp_path / "ckpt0", epoch=1)
    (tmp_path / "ckpt1").mkdir()  # rank 1's node-local folder: empty
    args = [LAUNCH, "train", "--plan", str(plan), "--device", "cpu", "--epochs", "2", "--model", f"{FIX}:model",
            "--dataset", f"{FIX}:dataset", "--checkpoint", str(tmp_path / "ckpt{rank}"), "--resume"]
    codes, out, err, _ = _ranks.run_each(args, timeout_s=DEADLINE_S)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 2 and lines[0] == lines[1], err[-3000:]
    line = lines[0]
    assert line.startswith("error: ranks would resume differently: rank 0 resumes epoch 1 step 0 of checkpoint "), line
    assert "/ckpt0, rank 1 starts fresh (no checkpoint in " in line and "/ckpt1); every rank must" in line, line
    assert "copy rank 0's checkpoint.pt into every rank's folder" in line, line
    assert "Traceback" not in err and codes == [2, 2], (codes, err[-2000:])
    assert "epoch 1:" not in out  # no step was trained

    # The same checkpoint in both folders (a copy per node): the digests agree and the run resumes.
    shutil.copy(tmp_path / "ckpt0" / "checkpoint.pt", tmp_path / "ckpt1" / "checkpoint.pt")
    codes, out, err, _ = _ranks.run_each(args, timeout_s=DEADLINE_S)
    assert codes == [0, 0], (codes, err[-3000:])
    assert "resumed from" in out and "epoch 1:" in out, out[-2000:]


def planned_start_worker(rank: int, world: int, plan_path: str) -> None:
    run = PlannedRun(plan_path, quiet=True)
    run.sampler_for(_fixtures.DATASET_LEN, "cpu")
    assert run.sampler is not None
    saved = HeteroBatchSampler.from_plan(run.plan, rank, _fixtures.DATASET_LEN, seed=0)
    saved.set_epoch(1)
    if rank == 0:  # only rank 0 found a checkpoint to resume
        run.sampler.load_state_dict(saved.state_dict(4))
    with pytest.raises(ValidationError) as info:
        run.epoch_start(1 if rank == 0 else 0)
    assert str(info.value) == (
        "ranks start differently: rank 0 starts epoch 1 at step 4 with batches [7, 5], rank 1 starts epoch 0 at "
        "step 0 with batches [7, 5]; resume every rank from the same checkpoint (run.sampler.load_state_dict(state) "
        "with the same state on every rank) and start the same epoch"), str(info.value)


@pytest.mark.distributed
def test_planned_run_refuses_ranks_resumed_to_other_positions(tmp_path: Path) -> None:
    plan = write_plan(tmp_path / "plan.json", [7, 5])
    run_distributed(planned_start_worker, 2, str(plan), timeout_s=30)
