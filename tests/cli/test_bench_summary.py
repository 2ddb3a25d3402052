"""benchmarks/summarize_bench.py: the published tables are what the records give, a record reads as its raw file
does, and new `--rounds` launches fit in."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests._scripts import benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
DATA = ROOT / "tests" / "data"


def _module() -> ModuleType:
    return benchmark("summarize_bench")


sb = _module()


def test_the_docs_generated_blocks_match_the_records() -> None:
    # docs/PERFORMANCE.md's scenario tables and the README's table cannot drift from docs/results/.
    perf, readme = ROOT / "docs" / "PERFORMANCE.md", ROOT / "README.md"
    assert sb.main(["--check", str(perf)]) == 0
    for name in sb.SCENARIOS:
        assert sb.BEGIN.format(f"scenario: {name}") in perf.read_text()
    assert sb.BEGIN.format(sb.README_BLOCK) in readme.read_text(), \
        f"README.md lacks {sb.BEGIN.format(sb.README_BLOCK)} ... {sb.END.format(sb.README_BLOCK)}"
    assert sb.main(["--check", str(readme)]) == 0


def test_docs_results_holds_records_only_and_each_names_its_source() -> None:
    files = sorted(RESULTS.iterdir())
    assert files and all(p.suffix == ".json" for p in files)
    for p in files:
        d = json.loads(p.read_text())
        assert d["record"] == sb.RECORD_FORMAT and d["source"], p.name
        if d.get("kind") in sb.OTHER_KINDS:  # a GPU-suite part's launch (nodes, comm breakdown, promise)
            continue
        assert sb.is_bench(d), p.name
        assert p.name.startswith(sb.record_name(d, set()).rsplit("_", 1)[0] + "_"), p.name
    assert sum(p.stat().st_size for p in files) < 1 << 20  # compact: the raw launches they came from held 25 MB


def _strategy(rounds: list[float], batches: list[int], predicted_s: float, B: int) -> dict[str, Any]:
    med = sorted(rounds)[(len(rounds) - 1) // 2]
    return {"samples_per_s": med, "step_time_s": B / med, "predicted_step_time_s": predicted_s,
            "batch_sizes": batches, "rounds_samples_per_s": rounds, "loss": 2.3, "setup": {"sampler": "x"}}


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
                   "profile_batch_sizes": [[16, 32, 48], [16, 32, 48]], "plan": {"big": list(range(100))}}
    return out


def test_rounds_files_give_median_min_max_and_the_paired_plan_over_proportional(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(_bench(
        {"equal": [300.0, 310.0, 320.0], "proportional": [600.0, 640.0, 560.0], "plan": [630.0, 620.0, 700.0]})))
    (results / "b.json").write_text(json.dumps(_bench(
        {"equal": [305.0, 305.0, 305.0], "proportional": [610.0, 610.0, 610.0], "plan": [600.0, 600.0, 600.0]})))
    (results / "sampler.json").write_text(json.dumps({"n": 10, "samplers": {}}))  # not a bench result
    assert sb.main(["--results", str(results)]) == 0
    out, err = capsys.readouterr()
    row = next(x for x in out.splitlines() if x.startswith("| 2x CPU x86_64 | cifar_cnn"))
    # 2 launches x 3 rounds pooled; ratios paired within a launch and round: plan / equal 630/300, 620/310, ...
    assert "| 2 launches x 3 rounds |" in row
    pe = sorted([630 / 300, 620 / 310, 700 / 320] + [600 / 305] * 3)
    assert f"| {(pe[2] + pe[3]) / 2:.2f}x [{pe[0]:.2f}x-{pe[-1]:.2f}x] |" in row
    pp = sorted([630 / 600, 620 / 640, 700 / 560] + [600 / 610] * 3)
    assert f"| {(pp[2] + pp[3]) / 2:.3f} [{pp[0]:.3f}-{pp[-1]:.3f}], tie within the spread, plan ahead in 2 of 6 |" \
        in row
    # prediction error = measured / predicted - 1 of the plan's step: 64 / samples/s against 0.1 s predicted
    errs = sorted(64 / x / 0.1 - 1 for x in (630.0, 620.0, 700.0, 600.0, 600.0, 600.0))
    assert f"{100 * (errs[2] + errs[3]) / 2:+.1f}% [{100 * errs[0]:+.1f}% to {100 * errs[-1]:+.1f}%]" in row
    assert "`a.json`, `b.json`" in row and "step timer's mean interval" in row
    assert "sampler.json" in err  # named, never silently dropped


def test_a_record_reads_as_its_raw_file_and_compaction_is_idempotent(tmp_path: Path) -> None:
    raw = _bench({"equal": [300.0, 310.0, 320.0], "proportional": [600.0, 640.0, 560.0], "plan": [630.0, 620.0, 700.0]})
    for name in ("equal", "proportional", "plan"):
        raw[name]["window"] = {"steps": 29, "warmup_steps": 2, "seconds": 3.0, "start": ["barrier"]}
        raw[name]["rounds_window"] = [{"steps": 29, "seconds": 3.0}] * 3
    raw["meta"]["emulate_mode"] = "stall"
    sweep = {"runs": [raw, _bench({"equal": [1.0], "proportional": [2.0], "plan": [3.0]}, label="homogeneous")]}
    src = tmp_path / "cpu2_nccl2ch_sweep.json"  # a file-name setting the meta does not record
    src.write_text(json.dumps(sweep))
    out = tmp_path / "records"
    written = sb.write_records([src], out)
    assert [p.name for p in written] == ["cpux2_cifar_cnn_compute-skew_01.json", "cpux2_cifar_cnn_equal-ranks_01.json"]
    assert sb.write_records([src], out) == []  # each launch once: (source, run) already there
    for i, p in enumerate(written):
        rec = json.loads(p.read_text())
        assert (rec["source"], rec["run"]) == (src.name, i) and "plan" not in rec["meta"]
        assert dataclasses.replace(sb.launch_from(p.name, rec), file="") == \
            dataclasses.replace(sb.launch_from(src.name, sweep["runs"][i]), file="")
    assert "NCCL_MAX_NCHANNELS=2; stall emulation; synchronized window" in sb.launch_from("x", json.loads(
        written[0].read_text())).key[3]
    assert sum(p.stat().st_size for p in written) < src.stat().st_size


def _framework_raw(script: str) -> dict[str, Any]:
    """What benchmarks/frameworks_gpu.py and hf_gpu.py write, cut to what the summary reads."""
    plan = {"world_size": 2, "predicted": {"samples_per_s": 600.0}}
    rounds = [{"default": 300.0, "planned": 590.0}, {"default": 310.0, "planned": 600.0}]
    if script == "hf_gpu":
        hf_rounds = [{"round": i, "factor": f, "default": {"samples_per_s": r["default"] / f},
                      "planned": {"samples_per_s": r["planned"] / f}} for f in (2.0, 3.0)
                     for i, r in enumerate(rounds)]
        return {"benchmark": "hf_gpu", "args": {"size": "125m", "seq_len": 1024, "global_batch": 48, "amp": True,
                                                "calibrate": True}, "world_size": 2, "device": "NVIDIA H100",
                "emulate_mode": "interleave", "torch": "2", "rounds": hf_rounds,
                "setups": {"2": {"plan": plan}, "3": {"plan": plan}}}
    return {"benchmark": "frameworks_gpu", "framework": "lightning", "device": "NVIDIA H100", "torch": "2",
            "args": {"model": "resnet50", "global_batch": 512, "workers": 4, "no_amp": False},
            "heterogeneity": "emulated compute skew: rank 1 x3.0 (profiler.workloads.emulate.Slowdown)",
            "plan": plan, "rounds": rounds, "profile": {"big": list(range(100))}}


def test_framework_launches_become_records_of_their_own_table(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "h100x2_lightning_F3_block.json").write_text(json.dumps(_framework_raw("frameworks_gpu")))
    (raw / "h100x2_hf_F23.json").write_text(json.dumps(_framework_raw("hf_gpu")))
    out = tmp_path / "records"
    written = sb.write_records(sorted(raw.iterdir()), out)
    assert [p.name for p in written] == ["h100x2_tiny_lm-125m_hf-trainer_01.json",
                                         "h100x2_tiny_lm-125m_hf-trainer_02.json",
                                         "h100x2_resnet50_lightning-trainer_01.json"]
    from_raw, _ = sb.load(sorted(raw.iterdir()))
    from_records, _ = sb.load(written)
    assert sorted(repr(dataclasses.replace(la, file="")) for la in from_raw) == \
        sorted(repr(dataclasses.replace(la, file="")) for la in from_records)
    lightning = next(la for la in from_records if la.framework == "Lightning Trainer")
    assert lightning.key[2:] == ("emulated compute skew 1=3", "block emulation")
    table = sb.scenario_table(sb.groups_of(from_records), "frameworks")
    assert table.count("\n| 2x NVIDIA H100 |") == 3 and "calibrated" in table
    # planned / default paired per round (590/300, 600/310); error = predicted samples/s / measured - 1
    row = next(x for x in table.splitlines() if "Lightning" in x)
    pe = sorted([590 / 300, 600 / 310])
    assert f"| {(pe[0] + pe[1]) / 2:.2f}x [{pe[0]:.2f}x-{pe[1]:.2f}x] | - | - | - |" in row
    assert f"{100 * (600 / 595 - 1):+.1f}%" in row
    assert "Lightning" not in sb.scenario_table(sb.groups_of(from_records), "compute-skew")


def test_a_stale_block_fails_the_check_and_write_repairs_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(_bench(
        {"equal": [300.0], "proportional": [600.0], "plan": [700.0]})))
    doc = tmp_path / "doc.md"
    name = "scenario: compute-skew"
    doc.write_text(f"intro\n{sb.BEGIN.format(name)}\nold numbers\n{sb.END.format(name)}\nafter\n")
    assert sb.main(["--results", str(results), "--check", str(doc)]) == 1
    assert sb.main(["--results", str(results), "--write", str(doc)]) == 0
    assert sb.main(["--results", str(results), "--check", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("after\n") and "old numbers" not in text
    assert "| 1.167, one measurement, spread unknown |" in text
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert sb.main(["--results", str(results), "--check", str(plain)]) == 1  # a doc without a block is an error


@pytest.mark.parametrize(("ratios", "words"), [
    ([1.01, 1.02], "plan ahead in every measurement"),
    ([0.98, 0.99], "proportional ahead in every measurement"),
    ([0.99, 1.01, 1.02], "tie within the spread, plan ahead in 2 of 3"),
    ([1.2], "one measurement, spread unknown"),
    ([], "proportional not run"),
])
def test_the_verdict_says_a_tie_when_the_spread_straddles_one(ratios: list[float], words: str) -> None:
    assert sb.verdict(ratios) == words


@pytest.mark.parametrize(("het", "scenario"), [
    ("emulated compute skew 1=1", "equal-ranks"), ("homogeneous", "equal-ranks"),
    ("emulated compute skew 1=3", "compute-skew"), ("emulated compute skew 2=2,3=4", "compute-skew"),
    ("real loader skew (workers capped 1=2)", "loader-skew"),
    ("real co-tenant: a duty-0.5 bf16 matmul loop on GPU 1", "cotenant"),
    ("emulated compute skew 1=2; real device mix cuda:0,cuda:1,cpu,cpu", "device-mix"),
    ("emulated compute skew 1=2; emulated small memory 0=20 GiB (real out-of-memory errors)", "small-memory"),
    ("mid-run slowdown 1=3 (plan+replan)", "midrun"),
])
def test_each_heterogeneity_lands_in_its_scenario(het: str, scenario: str) -> None:
    assert sb.scenario(het) == scenario


def test_window_timed_launches_form_their_own_group_and_take_the_readme_row(monkeypatch: pytest.MonkeyPatch) -> None:
    old = _bench({"equal": [300.0], "proportional": [600.0], "plan": [600.0]})
    new = _bench({"equal": [300.0, 300.0, 300.0], "proportional": [600.0, 600.0, 600.0],
                  "plan": [660.0, 630.0, 645.0]})
    for name in ("equal", "proportional", "plan"):
        new[name]["window"] = {"steps": 29, "start": ["device_sync", "barrier"], "end": ["device_sync", "barrier"]}
    launches = [sb.launch_from("old.json", old), sb.launch_from("new.json", new)]
    assert len(sb.groups_of(launches)) == 2
    monkeypatch.setattr(sb, "HEADLINES", (("2x CPU", "cifar_cnn", "emulated compute skew 1=3", ""),))
    table = sb.readme_table(launches)
    row = table.splitlines()[-1]
    assert "synchronized window" in row and "| 1 launch x 3 rounds |" in row
    assert "| **2.15x [2.10x-2.20x]** | 2.00x [2.00x-2.00x] | 1.075 [1.050-1.100] (plan ahead in every measurement) |" \
        in row


def _record(source: str) -> dict[str, Any]:
    return next(d for d in (json.loads(p.read_text()) for p in RESULTS.glob("*.json")) if d["source"] == source)


def test_loader_windows_over_part_of_a_worker_cycle_form_their_own_group() -> None:
    """Loader-skew launches on 2x H100: the first timed the plan [455, 57] (16 and 2 workers, both loaders near
    the step) over 20 steps, the later ones over 32 (planner.cli.bench.window_steps): not pooled."""
    part = sb.launch_from("a.json", _record("h100x2_resnet50_loader_skew_s8.json"))
    whole = sb.launch_from("b.json", _record("h100x2_resnet50_loader_skew_s8b.json"))
    assert sb.PART_CYCLE in part.key[3] and sb.PART_CYCLE not in whole.key[3]
    assert part.key[:3] == whole.key[:3]
    # the raw file a test keeps reads the same as its record
    raw = json.loads((DATA / "h100x2_resnet50_loader_skew_bench_16_2_workers.json").read_text())
    assert dataclasses.replace(sb.launch_from("r", raw), file="") == \
        dataclasses.replace(sb.launch_from("r", _record("h100x2_resnet50_loader_skew_bench_16_2_workers.json")), file="")


def test_launches_with_the_loader_check_form_their_own_group() -> None:
    """A loader-fed launch whose profile the loader check corrected (meta.loader_check) predicts from another model
    than the launches without it: not pooled with them."""
    before = _record("h100x2_resnet50_loader_skew_s16.json")
    after = json.loads(json.dumps(before))
    after["meta"]["loader_check"] = True
    a, b = sb.launch_from("a.json", before), sb.launch_from("b.json", after)
    assert a.key[:3] == b.key[:3] and a.key[3] != b.key[3] and sb.LOADER_CHECK in b.key[3]
    # uint8 images normalized on the GPU (meta.gpu_normalize): cheaper workers, other plans
    after["meta"]["gpu_normalize"] = True
    c = sb.launch_from("c.json", after)
    assert c.key[:3] == b.key[:3] and c.key[3] == f"{b.key[3]}; {sb.UINT8}"


def test_each_emulation_mode_forms_its_own_group() -> None:
    """An F = 3 launch with the stall emulation (meta.emulate_mode) is not pooled with the interleave launches."""
    stall = sb.launch_from("a.json", _record("h100x2_resnet50_F3_stall_device_s16d.json"))
    assert "stall emulation" in stall.key[3]
    bench = _bench({"equal": [300.0], "proportional": [600.0], "plan": [600.0]})
    bench["meta"]["emulate_mode"] = "interleave"
    assert "interleaved emulation" in sb.launch_from("b.json", bench).key[3]
