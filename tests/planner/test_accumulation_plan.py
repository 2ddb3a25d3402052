"""Accumulation in the plan: JSON fields, fingerprint, schema, refusals at load, and the `planner plan` table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

import planner
from planner.cli import main
from planner.errors import ValidationError
from planner.jsonio import fingerprint
from planner.plan import Plan, RankPlan, micro_batch_sizes
from planner.profile import Profile
from tests.planner._profiles import linear_profile

ROOT = Path(__file__).resolve().parents[2]
OLD_PLAN = ROOT / "tests" / "data" / "bad" / "args_good_plan.json"  # written before accumulation existed
PLAN_SCHEMA = json.loads((ROOT / "planner" / "schemas" / "plan.schema.json").read_text())
CAPS_3100 = [900, 900, 650, 650]


def _capped() -> Profile:
    return linear_profile([0.001, 0.001, 0.004, 0.004], fixed_s=0.01, caps=CAPS_3100)


def _accumulating_plan() -> dict[str, Any]:
    return planner.solve(_capped(), global_batch=4096).to_dict()


def test_micro_batch_sizes_is_the_even_split_larger_first() -> None:
    assert micro_batch_sizes(10, 3) == [4, 3, 3]
    assert micro_batch_sizes(9, 3) == [3, 3, 3]
    assert micro_batch_sizes(4, 3) == [2, 1, 1]
    assert micro_batch_sizes(7, 1) == [7]
    for b, k in ((5, 0), (2, 3)):
        with pytest.raises(ValidationError, match="non-empty micro-batches"):
            micro_batch_sizes(b, k)


def test_rank_plan_defaults_keep_old_constructions_working() -> None:
    r = RankPlan(rank=0, batch_size=12, share=1.0, num_workers=0, predicted_step_time_s=0.1, bottleneck="compute")
    assert (r.accumulation_steps, r.micro_batch_size, r.micro_batches) == (1, 12, [12])
    r = RankPlan(rank=0, batch_size=10, share=1.0, num_workers=0, predicted_step_time_s=0.1, bottleneck="compute",
                 accumulation_steps=3)
    assert (r.micro_batch_size, r.micro_batches) == (4, [4, 3, 3])


def test_old_plans_load_unchanged() -> None:
    data = json.loads(OLD_PLAN.read_text())
    plan = Plan.load(OLD_PLAN)
    assert plan.fingerprint == data["fingerprint"] == "459928a65b70fdb8"
    assert plan.mode == "ddp" and plan.accumulation_steps == (1,) and plan.ranks[0].micro_batch_size == 16
    assert plan.to_dict() == data  # written back byte for byte the same content
    # A plan without accumulation hashes as before the fields existed.
    new = planner.solve(linear_profile([0.001, 0.002]), global_batch=300)
    old_hash = fingerprint({"world_size": 2, "global_batch": 300, "min_batch": 1,
                            "ranks": [[r.rank, r.batch_size, r.num_workers] for r in new.ranks]})
    assert new.fingerprint == old_hash
    written = new.to_dict()
    assert "mode" not in written and not any({"micro_batch_size", "accumulation_steps"} & set(r) for r in written["ranks"])


def test_accumulating_plan_round_trips_validates_and_fingerprints_the_micro_steps(tmp_path: Path) -> None:
    plan = planner.solve(_capped(), global_batch=4096)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again == plan and again.fingerprint == plan.fingerprint
    data = plan.to_dict()
    jsonschema.validate(data, PLAN_SCHEMA)
    assert [r["accumulation_steps"] for r in data["ranks"]] == [2, 2, 1, 1]
    assert list(data["ranks"][0])[:4] == ["rank", "batch_size", "micro_batch_size", "accumulation_steps"]
    other = plan.with_batch_sizes(plan.batch_sizes, [3, 2, 1, 1])  # same batches, another micro-step count
    assert other.fingerprint != plan.fingerprint
    fsdp = planner.solve(_capped(), global_batch=4096, mode="fsdp")
    jsonschema.validate(fsdp.to_dict(), PLAN_SCHEMA)
    assert fsdp.to_dict()["mode"] == "fsdp" and Plan.from_dict(fsdp.to_dict()).mode == "fsdp"
    assert fsdp.options.mode == "fsdp"
    one_step_fsdp = planner.solve(linear_profile([0.001, 0.002]), global_batch=300, mode="fsdp")
    assert one_step_fsdp.fingerprint != planner.solve(linear_profile([0.001, 0.002]), global_batch=300).fingerprint


def _rehash(d: dict[str, Any]) -> dict[str, Any]:
    """Fix the fingerprint after an edit, as a careful hand-editor would: only the check under test may refuse."""
    acc = any(r.get("accumulation_steps", 1) > 1 for r in d["ranks"] if isinstance(r.get("accumulation_steps"), int))
    content: dict[str, Any] = {
        "world_size": d["world_size"], "global_batch": d["global_batch"], "min_batch": d["min_batch"],
        "ranks": [[r["rank"], r["batch_size"], r["num_workers"]]
                  + ([r.get("micro_batch_size"), r.get("accumulation_steps")] if acc else []) for r in d["ranks"]],
    }
    if d.get("mode", "ddp") != "ddp":
        content["mode"] = d["mode"]
    d["fingerprint"] = fingerprint(content)
    return d


DROP = object()
# (edits: (rank or None for the top level, field, value or DROP), what the one-line refusal says).  The solved plan
# is batches [1637, 1637, 411, 411] in [2, 2, 1, 1] micro-steps of at most [819, 819, 411, 411], caps 900/650.
BAD: dict[str, tuple[list[tuple[int | None, str, Any]], str]] = {
    "micro above the cap": ([(0, "micro_batch_size", 1637), (0, "accumulation_steps", 1)],
                            "micro_batch_size 1637 is above the rank's max_batch_size 900"),
    "zero steps": ([(0, "accumulation_steps", 0)], "accumulation_steps: must be >= 1, got 0"),
    "micro too small": ([(0, "micro_batch_size", 800)],
                        "micro_batch_size 800 x accumulation_steps 2 does not split batch_size 1637"),
    "micro too large": ([(0, "micro_batch_size", 900)],
                        "micro_batch_size 900 x accumulation_steps 2 does not split batch_size 1637"),
    "unequal under fsdp": ([(None, "mode", "fsdp")],
                           "plan.mode is fsdp but the ranks run [2, 2, 1, 1] accumulation steps"),
    "half the pair": ([(2, "accumulation_steps", DROP)], "give both micro_batch_size and accumulation_steps"),
    "unknown mode": ([(None, "mode", "zero3")], "mode: 'zero3' is not one of ddp, fsdp"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_accumulation_is_refused_at_load_with_one_line(name: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    edits, needle = BAD[name]
    data = _accumulating_plan()
    assert [r["batch_size"] for r in data["ranks"]] == [1637, 1637, 411, 411]
    for rank, field, value in edits:
        node = data if rank is None else data["ranks"][rank]
        if value is DROP:
            del node[field]
        else:
            node[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(_rehash(data)))
    with pytest.raises(ValidationError) as err:
        Plan.load(path)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert main(["validate", str(path)]) == 2
    out, errtext = capsys.readouterr()
    assert out == "" and len(errtext.strip().splitlines()) == 1 and needle in errtext and "Traceback" not in errtext
    if name in ("zero steps", "half the pair", "unknown mode"):  # what the schema alone can see, it refuses too
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(data, PLAN_SCHEMA)


def test_rank_plans_built_in_code_are_checked_too() -> None:
    base = {"rank": 0, "share": 1.0, "num_workers": 0, "predicted_step_time_s": 0.1, "bottleneck": "compute"}
    with pytest.raises(ValidationError, match="micro_batch_size 500 is above the rank's max_batch_size 400"):
        RankPlan(**base, batch_size=1000, accumulation_steps=2, max_batch_size=400)
    with pytest.raises(ValidationError, match="leave a micro-batch empty"):
        RankPlan(**base, batch_size=3, accumulation_steps=4)
    one = RankPlan(**base, batch_size=1000, max_batch_size=400)  # one micro-step over the cap: as before, allowed
    assert one.micro_batch_size == 1000


def test_plan_cli_accumulates_above_the_sum_of_caps_and_says_why(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "profile.json"
    _capped().save(prof)
    out_path = tmp_path / "plan.json"
    assert main(["plan", "--profile", str(prof), "--global-batch", "4096", "--out", str(out_path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "micro-batches" in out.splitlines()[0]
    assert "global batch 4096 exceeds the sum of memory caps 3100: ranks accumulate (rank 0: 2 x 819, rank 1: 2 x 819)" \
        in out
    plan = Plan.load(out_path)
    assert plan.accumulation_steps == (2, 2, 1, 1)
    assert main(["validate", str(out_path)]) == 0
    assert "up to 2 micro-steps per rank" in capsys.readouterr().out
    # fsdp: the same micro-step count on every rank
    assert main(["plan", "--profile", str(prof), "--global-batch", "4096", "--mode", "fsdp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "fsdp" and len({r["accumulation_steps"] for r in data["ranks"]}) == 1
    # Without accumulation the old refusal stands, as one line with the numbers.
    assert main(["plan", "--profile", str(prof), "--global-batch", "4096", "--max-accumulation-steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert "global batch 4096 exceeds the sum of memory caps 3100: ranks 0..3 cap at 900, 900, 650, 650" in err
    assert "--max-accumulation-steps 2 would reach it" in err


def test_plan_table_is_unchanged_without_accumulation(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    prof = tmp_path / "profile.json"
    linear_profile([0.001, 0.002]).save(prof)
    assert main(["plan", "--profile", str(prof), "--global-batch", "300"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["rank", "device", "batch", "share", "workers", "step", "ms", "bottleneck"]
    assert "accumulate" not in out


def test_profile_optimizer_step_s_is_optional_validated_and_in_the_schema() -> None:
    schema = json.loads((ROOT / "planner" / "schemas" / "profile.schema.json").read_text())
    prof = linear_profile([0.001, 0.002])
    data = prof.to_dict()
    assert "optimizer_step_s" not in data["ranks"][0]  # absent stays absent
    data["ranks"][0]["optimizer_step_s"] = 0.004
    jsonschema.validate(data, schema)
    assert Profile.from_dict(data).rank(0).optimizer_step_s == 0.004
    assert Profile.from_dict(data).to_dict() == data
    data["ranks"][0]["optimizer_step_s"] = -1
    with pytest.raises(ValidationError, match=r"ranks\[0\]\.optimizer_step_s: must be >= 0"):
        Profile.from_dict(data)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, schema)
