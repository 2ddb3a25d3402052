"""The run log contract: typed records, one writer, one reader, a schema per line, `planner validate` on a log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
from referencing import Registry, Resource

import planner
from planner.cli import main
from planner.errors import ValidationError
from planner.runlog import (
    EndRecord,
    EpochRecord,
    ReplanRecord,
    ResizeRecord,
    RunLogWriter,
    StartRecord,
    read_run_log,
)
from tests.planner._profiles import MINIMAL

SCHEMAS = Path(__file__).resolve().parents[2] / "planner" / "schemas"


def _validator() -> jsonschema.protocols.Validator:
    schemas = {n: json.loads((SCHEMAS / f"{n}.schema.json").read_text()) for n in ("runlog", "plan")}
    registry: Registry = Registry().with_resources(
        (s["$id"], Resource.from_contents(s)) for s in schemas.values())
    jsonschema.Draft202012Validator.check_schema(schemas["runlog"])
    return jsonschema.Draft202012Validator(schemas["runlog"], registry=registry)


def _records(plan: planner.Plan) -> list:
    stats = tuple(planner.StepStats(rank=r.rank, epoch=0, num_steps=20, batch_size=r.batch_size,
                                    num_workers=r.num_workers, data_wait_s=0.001, compute_s=0.05 * (1 + r.rank),
                                    step_time_s=0.11, compute_s_std=0.002) for r in plan.ranks)
    return [
        StartRecord(time=1.0, world_size=plan.world_size, global_batch=plan.global_batch, plan=plan),
        EpochRecord(epoch=0, plan_fingerprint=plan.fingerprint, samples_per_s=4000.0, step_time_s=0.11, loss=2.5,
                    batch_sizes=plan.batch_sizes, predicted_step_time_s=(0.1, 0.1), ranks=stats, wall_s=16.0,
                    samples=51200),
        ReplanRecord(epoch=0, adopted=True, reason="adopted", predicted_gain=0.12, old_batch_sizes=(256, 256),
                     new_batch_sizes=plan.batch_sizes, measured_compute_s=(0.05, math.nan),
                     predicted_compute_s=(0.05, 0.1), plan=plan),
        ReplanRecord(epoch=1, adopted=True, reason="reverted: slower", predicted_gain=None,
                     old_batch_sizes=plan.batch_sizes, new_batch_sizes=(256, 256), event="revert"),
        ResizeRecord(time=2.0, epoch=1, step=3, old_world_size=2, new_world_size=2, old_batch_sizes=(256, 256),
                     new_batch_sizes=plan.batch_sizes, plan=plan),
        # A diverged epoch: non-finite numbers become null, the line stays strict JSON.
        EpochRecord(epoch=1, plan_fingerprint=plan.fingerprint, samples_per_s=math.inf, step_time_s=0.1,
                    loss=math.nan, batch_sizes=plan.batch_sizes, predicted_step_time_s=(0.1, 0.1), ranks=stats),
        EndRecord(time=3.0, epochs=2),
    ]


def test_what_the_writer_writes_the_schema_accepts_and_the_reader_reads_back(tmp_path: Path) -> None:
    plan = planner.solve(planner.Profile.load(MINIMAL), global_batch=512)
    path = tmp_path / "run.jsonl"
    with RunLogWriter(path) as log:
        for rec in _records(plan):
            log.write(rec)
    lines = path.read_text().splitlines()
    validator = _validator()
    for line in lines:
        validator.validate(json.loads(line))  # strict JSON (no NaN tokens) and typed
    assert json.loads(lines[5])["loss"] is None and json.loads(lines[2])["measured_compute_s"] == [0.05, None]
    got = read_run_log(path, strict_plans=True)
    assert got.world_size == 2 and got.global_batch == 512 and got.start_plan == plan and got.ended
    assert [e.epoch for e in got.epochs] == [0, 1] and got.epochs[0].ranks == _records(plan)[1].ranks
    assert got.epochs[0].measured_busy_s == pytest.approx((0.051, 0.101))
    assert got.epochs[1].loss is None
    assert got.epochs[0].wall_samples_per_s == 3200.0 and got.epochs[1].wall_samples_per_s is None  # optional
    assert [r.event for r in got.replans] == ["replan", "revert"] and got.replans[1].reverted
    assert got.resizes[0].new_batch_sizes == plan.batch_sizes


def test_a_disabled_writer_writes_nothing(tmp_path: Path) -> None:
    log = RunLogWriter(tmp_path / "run.jsonl", enabled=False)  # every rank but 0
    log.write(EndRecord(time=0.0, epochs=1))
    log.close()
    assert not (tmp_path / "run.jsonl").exists()


def test_reader_refuses_wrong_types_and_nan_tokens(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"event": "start", "world_size": "two", "global_batch": 8}\n')
    with pytest.raises(ValidationError, match=r"bad.jsonl:1: 'world_size' must be an integer"):
        read_run_log(p)
    p.write_text('{"event": "epoch", "epoch": 0, "loss": NaN, "ranks": []}\n{"event": "end"}\n')
    with pytest.raises(ValidationError, match=r"bad.jsonl:1: record.loss: must be a finite number"):
        read_run_log(p)


def test_validate_checks_a_run_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = planner.solve(planner.Profile.load(MINIMAL), global_batch=512)
    good = tmp_path / "run.jsonl"
    with RunLogWriter(good) as log:
        for rec in _records(plan):
            log.write(rec)
    assert main(["validate", str(good)]) == 0
    assert "valid run log, 2 epoch(s), 2 re-plan decision(s), finished" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    start = json.loads(good.read_text().splitlines()[0])
    start["plan"]["ranks"][0]["batch_size"] += 1  # the plan no longer sums to its global batch
    bad.write_text(json.dumps(start) + "\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jsonl:1.plan" in err
