"""benchmarks/summarize_bench.py: the published tables are what the raw files give, and new `--rounds` files fit in."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests._scripts import benchmark

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    return benchmark("summarize_bench")


sb = _module()


def test_the_docs_generated_blocks_match_the_raw_files() -> None:
    # The README headline and docs/BENCHMARKS.md section 0 cannot drift from docs/results/.
    assert sb.main(["--check", str(ROOT / "docs" / "BENCHMARKS.md"), str(ROOT / "README.md")]) == 0
    assert sb.BEGIN.format("") in (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert sb.BEGIN.format(" --readme") in (ROOT / "README.md").read_text()


def _strategy(rounds: list[float], batches: list[int], predicted_s: float, B: int) -> dict[str, Any]:
    med = sorted(rounds)[(len(rounds) - 1) // 2]
    return {"samples_per_s": med, "step_time_s": B / med, "predicted_step_time_s": predicted_s,
            "batch_sizes": batches, "rounds_samples_per_s": rounds}


def _bench(rounds: dict[str, list[float]], *, label: str = "emulated compute skew 1=3") -> dict[str, Any]:
    """A `planner bench --rounds 3 --json` result: the keys the summary reads, as planner/cli/bench.py writes them."""
    B = 64
    out: dict[str, Any] = {
        "equal": _strategy(rounds["equal"], [32, 32], 0.2, B),
        "proportional": _strategy(rounds["proportional"], [48, 16], 0.1, B),
        "plan": _strategy(rounds["plan"], [50, 14], 0.1, B),
        "ideal": {"samples_per_s": 800.0, "batch_sizes": [50, 14]},
    }
    out["meta"] = {"world_size": 2, "global_batch": B, "model": "cifar_cnn", "amp": False, "data": "synthetic",
                   "devices": ["CPU x86_64", "CPU x86_64"], "heterogeneity": label, "late_slowdown": None,
                   "profile_batch_sizes": [[16, 32, 48], [16, 32, 48]]}
    return out


def test_rounds_files_give_median_min_max_per_strategy_and_the_paired_plan_over_proportional(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(_bench(
        {"equal": [300.0, 310.0, 320.0], "proportional": [600.0, 640.0, 560.0], "plan": [630.0, 620.0, 700.0]})))
    (results / "b.json").write_text(json.dumps(_bench(
        {"equal": [305.0, 305.0, 305.0], "proportional": [610.0, 610.0, 610.0], "plan": [600.0, 600.0, 600.0]})))
    (results / "sampler.json").write_text(json.dumps({"n": 10, "samplers": {}}))  # not a bench result
    assert sb.main(["--results", str(results)]) == 0
    out = capsys.readouterr().out
    # 2 launches x 3 rounds pooled: equal 300..320, median of [300, 310, 320, 305, 305, 305] = 305
    assert "2 launches x 3 rounds" in out
    assert "| equal | 32 / 32 | 305 [300-320] |" in out
    assert "| proportional | 48 / 16 | 610 [560-640] |" in out
    assert "| plan | 50 / 14 | 610 [600-700] |" in out
    # paired within a launch and round: 630/600, 620/640, 700/560, 600/610 x3 -> median of the six
    ratios = sorted([630 / 600, 620 / 640, 700 / 560] + [600 / 610] * 3)
    med = (ratios[2] + ratios[3]) / 2
    assert f"plan / proportional: {med:.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}] -- tie within the spread, plan ahead " \
           "in 2 of 6." in out
    # in-sample from the profile's measured batches: 32/32 and 48/16 were measured, 50/14 was not
    assert "| in-sample |" in out and out.count("| yes |") == 2 and "| no |" in out
    # prediction error = measured / predicted - 1: equal's median step 64/305 s against 0.2 s predicted
    assert f"{100 * (64 / 305 / 0.2 - 1):+.1f}%" in out
    assert "Not bench results" in out and "`sampler.json`" in out


def test_a_stale_block_fails_the_check_and_write_repairs_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(_bench(
        {"equal": [300.0], "proportional": [600.0], "plan": [700.0]})))
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{sb.BEGIN.format('')}\nold numbers\n{sb.END.format('')}\nafter\n")
    assert sb.main(["--results", str(results), "--check", str(doc)]) == 1
    assert sb.main(["--results", str(results), "--write", str(doc)]) == 0
    assert sb.main(["--results", str(results), "--check", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("after\n") and "old numbers" not in text
    assert "plan / proportional: 1.167 -- one measurement, spread unknown." in text


@pytest.mark.parametrize(("ratios", "words"), [
    ([1.01, 1.02], "plan ahead in every measurement"),
    ([0.98, 0.99], "proportional ahead in every measurement"),
    ([0.99, 1.01, 1.02], "tie within the spread, plan ahead in 2 of 3"),
    ([1.2], "one measurement, spread unknown"),
    ([], "proportional not run"),
])
def test_the_verdict_says_a_tie_when_the_spread_straddles_one(ratios: list[float], words: str) -> None:
    assert sb.verdict(ratios) == words


def test_window_timed_launches_form_their_own_group_and_take_the_headline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = _bench({"equal": [300.0], "proportional": [600.0], "plan": [600.0]})
    new = _bench({"equal": [300.0, 300.0, 300.0], "proportional": [600.0, 600.0, 600.0],
                  "plan": [660.0, 630.0, 645.0]})
    for name in ("equal", "proportional", "plan"):
        new[name]["window"] = {"steps": 29, "start": ["device_sync", "barrier"], "end": ["device_sync", "barrier"]}
    launches = [sb.launch_from("old.json", old), sb.launch_from("new.json", new)]
    assert len(sb.groups_of(launches)) == 2
    monkeypatch.setattr(sb, "HEADLINES", (("2x CPU", "cifar_cnn", "emulated compute skew 1=3", ""),))
    line = sb.headline(launches)
    assert "synchronized window" in line and "1 launch x 3 rounds" in line
    assert "plan **2.150x [2.100x-2.200x]** DistributedSampler" in line
    assert "1.075x [1.050x-1.100x] the throughput-proportional split (plan ahead in every measurement)" in line


def test_loader_windows_over_part_of_a_worker_cycle_form_their_own_group() -> None:
    """Session 8's loader-skew launches on 2x H100: the first timed the plan [455, 57] (16 and 2 workers, both
    loaders near the step) over 20 steps, the later ones over 32 (planner.cli.bench.window_steps): not pooled."""
    results = ROOT / "docs" / "results"
    part = sb.launch_from("a.json", json.loads((results / "h100x2_resnet50_loader_skew_s8.json").read_text()))
    whole = sb.launch_from("b.json", json.loads((results / "h100x2_resnet50_loader_skew_s8b.json").read_text()))
    assert sb.PART_CYCLE in part.key[3] and sb.PART_CYCLE not in whole.key[3]
    assert part.key[:3] == whole.key[:3]


def test_launches_with_the_loader_check_form_their_own_group() -> None:
    """A loader-fed launch whose profile the loader check corrected (meta.loader_check, session 17) predicts from
    another model than the launches before it: not pooled with them."""
    results = ROOT / "docs" / "results"
    before = json.loads((results / "h100x2_resnet50_loader_skew_s16.json").read_text())
    after = json.loads(json.dumps(before))
    after["meta"]["loader_check"] = {"seconds": 3.0, "changed": True}
    a, b = sb.launch_from("a.json", before), sb.launch_from("b.json", after)
    assert a.key[:3] == b.key[:3] and a.key[3] != b.key[3] and sb.LOADER_CHECK in b.key[3]
    # uint8 images normalized on the GPU (meta.gpu_normalize, session 18): cheaper workers, other plans
    after["meta"]["gpu_normalize"] = True
    c = sb.launch_from("c.json", after)
    assert c.key[:3] == b.key[:3] and c.key[3] == f"{b.key[3]}; {sb.UINT8}"


def test_each_emulation_mode_forms_its_own_group() -> None:
    """Session 16's F = 3 launch with the stall emulation (PLANNER_EMULATE_MODE=stall, meta.emulate_mode) is not
    pooled with the default interleave launches at F = 3."""
    results = ROOT / "docs" / "results"
    stall = sb.launch_from("a.json", json.loads((results / "h100x2_resnet50_F3_stall_device_s16d.json").read_text()))
    assert "stall emulation" in stall.key[3]
    bench = _bench({"equal": [300.0], "proportional": [600.0], "plan": [600.0]})
    bench["meta"]["emulate_mode"] = "interleave"
    assert "interleaved emulation" in sb.launch_from("b.json", bench).key[3]
