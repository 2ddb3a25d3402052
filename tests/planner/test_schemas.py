"""The published JSON Schemas agree with the loaders: what we write validates; what they refuse, we refuse."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

import planner
from planner.errors import ValidationError
from planner.profile import Profile
from tests.planner._profiles import MINIMAL, linear_profile
from tests.planner.test_cli import BAD_PROFILES

SCHEMAS = Path(__file__).resolve().parents[2] / "planner" / "schemas"


def _schema(name: str) -> dict:
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def test_written_files_validate_against_the_schemas() -> None:
    prof_schema, plan_schema = _schema("profile"), _schema("plan")
    minimal = json.loads(MINIMAL.read_text())
    jsonschema.validate(minimal, prof_schema)
    profile = Profile.from_dict(minimal)
    jsonschema.validate(profile.to_dict(), prof_schema)
    jsonschema.validate(planner.solve(profile, global_batch=512).to_dict(), plan_schema)
    lp = linear_profile([0.001, 0.002], caps=[100, None], loader_s=[0.001, 0.002])
    jsonschema.validate(lp.to_dict(), prof_schema)
    jsonschema.validate(planner.solve(lp, global_batch=150).to_dict(), plan_schema)


@pytest.mark.parametrize("name", sorted(n for n in BAD_PROFILES if n not in {"duplicate rank", "unknown host"}))
def test_schema_refuses_what_the_loader_refuses(name: str) -> None:
    data, _ = BAD_PROFILES[name]
    with pytest.raises(ValidationError):
        Profile.from_dict(data)
    if name == "NaN time":
        return  # JSON has no NaN: the schema never sees one (the loader refuses it)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(data, _schema("profile"))
