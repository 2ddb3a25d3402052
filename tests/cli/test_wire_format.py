"""CommProfile.grad_compress: a profile says in which format its DDP steps sent the gradients
(`planner profile --grad-compress`), and a run sending another is told its plan's printed step does not hold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from planner import Profile
from planner.cli.train import wire_format_warning
from planner.errors import ValidationError
from planner.profile import CommProfile, ComputePoint, HostProfile, RankProfile

ROOT = Path(__file__).resolve().parents[2]


def _profile(comm: CommProfile | None) -> Profile:
    pts = tuple(ComputePoint(batch_size=b, step_time_s=0.001 * b) for b in (8, 16, 32))
    ranks = tuple(RankProfile(rank=i, host="h", device=f"cuda:{i}", compute=pts) for i in range(2))
    return Profile(hosts=(HostProfile(name="h", cpu_cores=8),), ranks=ranks, comm=comm)


def test_the_wire_format_round_trips_and_a_different_run_is_warned() -> None:
    bf16 = _profile(CommProfile(backend="nccl", exposed_s=0.002, grad_compress="bf16"))
    data = bf16.to_dict()
    jsonschema.validate(data, json.loads((ROOT / "planner" / "schemas" / "profile.schema.json").read_text()))
    assert Profile.from_dict(json.loads(json.dumps(data))) == bf16
    plain = _profile(CommProfile(backend="nccl", exposed_s=0.002))
    assert "grad_compress" not in plain.to_dict()["comm"]
    assert wire_format_warning(bf16, "bf16") is None and wire_format_warning(plain, "none") is None
    line = wire_format_warning(plain, "bf16")
    assert line is not None and "sent gradients as none, this run sends bf16" in line
    assert "planner profile --grad-compress bf16" in line
    assert "as bf16, this run sends none" in (wire_format_warning(bf16, "none") or "")
    # Nothing measured, nothing to contradict.
    assert wire_format_warning(_profile(None), "bf16") is None and wire_format_warning(None, "bf16") is None
    bad = json.loads(json.dumps(data))
    bad["comm"]["grad_compress"] = "int8"
    with pytest.raises(ValidationError, match="'int8' is not a gradient wire format; one of bf16, fp16"):
        Profile.from_dict(bad)
    assert dataclasses.replace(bf16.comm, grad_compress=None) == plain.comm  # type: ignore[type-var]
