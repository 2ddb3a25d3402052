"""Values echoed in error lines: a long one is cut and says its length; two that differ never read the same."""

from __future__ import annotations

import pytest

from planner.argcheck import ResumeValue, check_resume
from planner.errors import ValidationError
from planner.shown import shown, shown_apart


def test_a_long_value_is_cut_and_says_its_length() -> None:
    assert shown("cuda:0") == '"cuda:0"'
    assert shown("A" * 5000) == '"' + "A" * 36 + '... (5,000 characters)'
    assert shown(list(range(1000)), 20).endswith("... (1,000 items)")
    assert shown(float("nan")) == "nan" and shown("\x1b[2J") == '"\\u001b[2J"'  # one printable line


def test_values_that_differ_past_the_cut_are_shown_where_they_differ() -> None:
    a, b = "/scratch/job1234/node-a/ckpt", "/scratch/job1234/node-b/ckpt"
    assert shown(a, 12) == shown(b, 12)  # what a plain cut does
    there, here = shown_apart([a, b], 12, text=str)
    assert there != here and "node-a" in there and "node-b" in here and "of 28" in there, (there, here)
    assert shown_apart(["short", "other"]) == ['"short"', '"other"']  # no cut, nothing to move
    long_a, long_b = "x" * 5000 + "1", "x" * 5000 + "2"
    there, here = shown_apart([long_a, long_b])
    assert there.endswith('1" (from character 4,982 of 5,003)') and here.endswith('2" (from character 4,982 of 5,003)')


def test_ranks_that_disagree_past_the_cut_are_told_apart() -> None:
    from runtime.safety import _raise_on_disagreement

    by_rank = {0: {"--checkpoint": "/scratch/job1234/node-a/ckpt"}, 1: {"--checkpoint": "/scratch/job1234/node-b/ckpt"}}
    with pytest.raises(ValidationError) as info:
        _raise_on_disagreement(by_rank, {"--checkpoint": "launch every rank with the same --checkpoint"}, width=10)
    text = str(info.value)
    assert "rank 0 has ...ob1234/node-a/ckpt" in text and "rank 1 has ...ob1234/node-b/ckpt" in text, text


def test_a_resume_change_past_the_cut_is_told_apart_and_capped() -> None:
    saved, given = "imagefolder:" + "/d" * 100 + "/train", "imagefolder:" + "/d" * 100 + "/valid"
    with pytest.raises(ValidationError) as info:
        check_resume([ResumeValue(flag="--dataset", saved=saved, given=given)], allow=False)
    text = str(info.value)
    assert "valid" in text.split("differs")[0] and "train" in text.split("differs")[1], text
    assert len(text) < 500, len(text)  # each of its three values cut to 80 characters
