"""A 200-rank report: bounded work, findings that summarise, figures that stay readable.

It took 87 s and opened with a 2,565-character finding listing every binding rank: every what-if re-solved the
200-rank program once per rank (and once per "kind" when unnamed ranks all measure differently: 200 kinds).
The speed goal (<= 10 s on the 2-core box) is measured by benchmarks/report_scale.py, not here; this test pins
what makes it hold -- the number of solves -- and the shape of the findings.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

import planner
from planner.cli import main
from planner.profile import ComputePoint, HostProfile, LoaderProfile, MemoryPoint, MemoryProfile, Profile, RankProfile
from reports.analysis import analyze

MAX_SOLVES = 70
"""sweep (~20) + drops, additions and upgrades (<= 8 each) + scaling (~16) + 1; it was ~600."""


def cluster(n: int = 200, seed: int = 0) -> Profile:
    """Every rank measured apart (no device names, 1-4x speed spread), 8 per host on 8-64 cores, loaders heavy
    enough that some hosts run short of cores: the case where every rank is its own "kind"."""
    rng = np.random.default_rng(seed)
    hosts = tuple(HostProfile(name=f"h{i}", cpu_cores=int(rng.integers(8, 64))) for i in range((n + 7) // 8))
    ranks = []
    for i in range(n):
        f = float(rng.uniform(1, 4))
        base, slope = float(rng.uniform(0.003, 0.01)), float(rng.uniform(5e-5, 3e-4))
        ranks.append(RankProfile(
            rank=i, host=f"h{i // 8}", device=f"cuda:{i % 8}",
            compute=tuple(ComputePoint(batch_size=b, step_time_s=f * (base + slope * max(b, 32)))
                          for b in (8, 32, 128, 512)),
            memory=MemoryProfile(capacity_bytes=int(rng.uniform(16e9, 80e9)),
                                 points=(MemoryPoint(batch_size=32, peak_bytes=2_000_000_000),
                                         MemoryPoint(batch_size=512, peak_bytes=20_000_000_000))),
            loader=LoaderProfile(sec_per_sample=float(rng.uniform(1e-4, 2e-3)))))
    return Profile(hosts=hosts, ranks=tuple(ranks))


def _png_height(png: bytes) -> int:
    return int(struct.unpack(">I", png[20:24])[0])  # IHDR: width at 16, height at 20


@pytest.mark.slow
def test_a_200_rank_report_does_bounded_work_and_summarises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`planner report` on 200 ranks, once: the solves it makes are counted, its findings and figures checked."""
    import reports.analysis
    import reports.figures
    import reports.whatif

    calls = []
    real = planner.solve

    def counting(*a: object, **k: object) -> planner.Plan:
        calls.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    made: dict[str, object] = {}
    real_analyze, real_render = reports.analysis.analyze, reports.figures.render_all

    def analyzed(*a: object, **k: object) -> object:
        made["report"] = real_analyze(*a, **k)  # type: ignore[arg-type]
        return made["report"]

    def rendered(rep: object) -> dict[str, bytes]:
        made["pngs"] = real_render(rep)  # type: ignore[arg-type]
        return made["pngs"]  # type: ignore[return-value]

    monkeypatch.setattr(reports.whatif, "solve", counting)
    monkeypatch.setattr(reports.analysis, "solve", counting)
    monkeypatch.setattr(reports.analysis, "analyze", analyzed)  # planner.cli.cmd_report imports them when it runs
    monkeypatch.setattr(reports.figures, "render_all", rendered)
    cluster().save(tmp_path / "p.json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = main(["report", "--profile", str(tmp_path / "p.json"), "--global-batch", "51200", "--out",
                   str(tmp_path / "r.html")])
    out, err = capsys.readouterr()
    assert rc == 0 and err == "", err
    printed = out.splitlines()[1]
    assert printed.startswith("  - Step time") and len(printed) <= 310
    assert len(calls) <= MAX_SOLVES, f"{len(calls)} solves of a 200-rank program"

    rep = made["report"]
    assert isinstance(rep, reports.analysis.Report)
    lines = rep.findings.lines
    first = lines[0]
    assert len(first) <= 300, first
    assert "of 200 ranks" in first and " more" in first, first  # counted and summarised, not listed
    assert all(len(line) <= 400 for line in lines), max(lines, key=len)
    loader = [line for line in lines if "loader-starved" in line]
    assert len(loader) == 1 and "ranks on" in loader[0] and "hosts are loader-starved" in loader[0]
    kinds = {w.kind for w in rep.what_ifs}
    assert kinds == {"drop", "add", "upgrade"} and len(rep.what_ifs) <= 24
    assert rep.scaling[0].num_ranks == 1 and rep.scaling[-1].num_ranks == 200 and len(rep.scaling) <= 20

    assert [str(w.message) for w in caught] == []  # 200 cap lines in the legend collapsed the layout
    pngs = made["pngs"]
    assert isinstance(pngs, dict) and max(_png_height(p) for p in pngs.values()) <= 1200  # was 0.45 inch a rank


def test_small_clusters_keep_every_what_if() -> None:
    # At or under 32 ranks nothing is sampled: one drop per rank, every k of the scaling.
    from tests.reports._fixtures import three_rank_profile

    prof = three_rank_profile()
    rep = analyze(prof, planner.solve(prof, global_batch=700), planner.SolveOptions())
    assert sorted(w.subject_rank for w in rep.what_ifs if w.kind == "drop") == [0, 1, 2]
    assert [p.num_ranks for p in rep.scaling] == [1, 2, 3]


def _long_log(tmp_path: Path, epochs: int) -> tuple[Profile, planner.Plan, Path]:
    """A 3-rank run log of `epochs` epochs, each with a rejected re-plan; rank 2 slows 2x in the last epoch."""
    import json

    from tests.reports._fixtures import three_rank_profile

    prof = three_rank_profile()
    plan = planner.solve(prof, global_batch=700)
    pred = [r.predicted_step_time_s for r in plan.ranks]
    lines = [json.dumps({"event": "start", "time": 1.0, "world_size": 3, "global_batch": 700, "plan": plan.to_dict()})]
    for e in range(epochs):
        slow = 2.0 if e == epochs - 1 else 1.0
        ranks = [{"rank": i, "epoch": e, "num_steps": 50, "batch_size": r.batch_size, "num_workers": 0,
                  "data_wait_s": 0.001, "compute_s": pred[i] * (slow if i == 2 else 1.0),
                  "step_time_s": max(pred) * slow} for i, r in enumerate(plan.ranks)]
        lines.append(json.dumps({"event": "epoch", "epoch": e, "plan_fingerprint": plan.fingerprint,
                                 "samples_per_s": 1000.0, "step_time_s": 0.41, "loss": 2.0, "ranks": ranks,
                                 "predicted_step_time_s": pred}))
        lines.append(json.dumps({"event": "replan", "epoch": e, "adopted": False, "reason": "gain below threshold",
                                 "predicted_gain": 0.001, "old_batch_sizes": list(plan.batch_sizes),
                                 "new_batch_sizes": list(plan.batch_sizes), "measured_compute_s": pred,
                                 "predicted_compute_s": pred, "plan": None}))
    path = tmp_path / f"log{epochs}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return prof, plan, path


def test_a_long_run_log_costs_what_a_short_one_does_in_the_figure(tmp_path: Path) -> None:
    """The run-log figure's artists and ticks do not grow with the epochs (a tick, a marker and a re-plan line
    per epoch made 1,000 epochs take 14 s and 20,000 minutes), and the slowdown finding is found at the end of a
    long log (its best-earlier-epoch search was quadratic)."""
    from planner.runlog import read_run_log
    from reports.causes import log_slowdowns
    from reports.figures import run_log

    sizes = {}
    for epochs in (30, 3000):
        prof, plan, path = _long_log(tmp_path, epochs)
        rep = analyze(prof, plan, plan.options, log=read_run_log(path))
        fig = run_log(rep)
        assert fig is not None
        axes = fig.get_axes()
        sizes[epochs] = [(len(ax.lines), len(ax.collections), len(ax.get_xticks()) <= 21) for ax in axes]
        slow = log_slowdowns(prof, read_run_log(path))
        assert [(s.rank, s.epoch) for s in slow] == [(2, epochs - 1)], slow
    assert sizes[30] == sizes[3000], sizes
    assert all(ticks_bounded for ax in sizes[3000] for ticks_bounded in ax[2:])
