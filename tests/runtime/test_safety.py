"""Pre-collective safety: ranks that disagree fail with one clear error instead of hanging; BatchNorm min_batch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from planner.errors import ValidationError
from runtime.safety import check_agreement, check_batchnorm
from tests._dist import run_distributed

GOOD = {"plan_fingerprint": "9f1c7a2b3d4e5f60", "dataset_len": 50_000, "seed": 0}
BAD = [
    ("plan_fingerprint", "03ab9c8d7e6f5a41",
     "ranks disagree on plan fingerprint: rank 0 has 9f1c7a2b3d.., rank 1 has 03ab9c8d7e..; "
     "launch every rank with the same --plan file"),
    ("dataset_len", 49_999, "ranks disagree on dataset length: rank 0 has 50000, rank 1 has 49999; "),
    ("seed", 1, "ranks disagree on seed: rank 0 has 0, rank 1 has 1; pass the same --seed"),
]


def agreement_worker(rank: int, world: int) -> None:
    check_agreement(**GOOD, world_size=world)  # type: ignore[arg-type]
    for field, value, expected in BAD:
        mine = dict(GOOD, **{field: value}) if rank == 1 else GOOD
        with pytest.raises(ValidationError) as info:
            check_agreement(**mine)  # type: ignore[arg-type]
        assert str(info.value).startswith(expected), str(info.value)
    with pytest.raises(ValidationError, match="every rank expects world size 4 but the process group has 2"):
        check_agreement(**GOOD, world_size=4)  # type: ignore[arg-type]
    # Settings beyond the sampler's: another --lr trains drifting replicas, another --epochs hangs a rank.
    agreed = {"--lr": 0.01, "--epochs": 10, "--weighting": "loss_scale", "--amp": False, "--model": "mlp"}
    check_agreement(**GOOD, settings=agreed)  # type: ignore[arg-type]
    for flag, value in (("--lr", 0.11), ("--epochs", 11), ("--amp", True)):
        mine = dict(agreed, **{flag: value}) if rank == 1 else agreed
        with pytest.raises(ValidationError) as info:
            check_agreement(**GOOD, settings=mine)  # type: ignore[arg-type]
        message = str(info.value)
        assert message.startswith(f"ranks disagree on {flag}: rank 0 has ") and "\n" not in message, message
        assert message.endswith(f"launch every rank with the same {flag}"), message


@pytest.mark.distributed
def test_disagreement_raises_on_every_rank() -> None:
    # three disagreements in one run; a rank stuck in a collective would hit the 15 s gloo timeout per check
    # and blow the 30 s harness deadline, so passing also means "fails fast"
    run_distributed(agreement_worker, 2, timeout_s=30)


def test_check_batchnorm() -> None:
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    with pytest.warns(UserWarning, match="convert_sync_batchnorm"):
        assert check_batchnorm(plain, 1) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_batchnorm(plain, 4) == 4
        assert check_batchnorm(nn.Linear(3, 4), 1) == 1
        synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
        assert check_batchnorm(synced, 1) == 1


def test_train_agrees_on_every_setting_that_must_match() -> None:
    from planner.cli.train_config import TrainConfig

    settings = TrainConfig(lr=0.05, epochs=3).agreed_settings()
    for flag in ("--lr", "--epochs", "--weighting", "--amp", "--model", "--dataset", "--replan",
                 "--replan-threshold", "--fsdp", "--num-samples", "--image-size"):
        assert flag in settings, flag
    assert settings["--lr"] == 0.05 and settings["--epochs"] == 3
    # per-rank by design: emulated slowdowns, loader caps, per-rank log paths
    assert not {"--slowdown", "--loader-workers-cap", "--step-log-path", "--quiet"} & set(settings)
