"""The compiled profile: the sweep's steps run through torch.compile, and each rank records its compile.

Backend ``aot_eager`` (dynamo's capture and AOT autograd's graphs, no code generation): what is counted -- graphs,
sizes, which module a step calls -- is decided by dynamo, and inductor's first compile costs a minute here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

import planner
from planner.errors import ValidationError
from profiler.api import UserStep, local_profile, profile_step
from profiler.compiled import CompileOptions, compile_options, compile_runner, compiled_graphs
from profiler.sweep import SweepOptions

SIZES = [4, 8, 16]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _batch(b: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(b, 16), "y": torch.randn(b, 1)}


class _Calls:
    """loss_fn that records the type of module each step called."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def __call__(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        compiled = isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
        self.kinds.append("compiled" if compiled else "eager")
        return F.mse_loss(module(batch["x"]), batch["y"])


def _sweep() -> SweepOptions:
    return SweepOptions.quick(batch_sizes=tuple(SIZES), spread_stop=None, min_repeats=3, max_repeats=3,
                              point_budget_s=0.0, warmup=1, warmup_next=1)


def test_a_compiled_profile_records_one_dynamic_graph_over_its_sizes_and_times_compiled_steps() -> None:
    calls = _Calls()
    before = compiled_graphs()
    rp = profile_step(_model(), _batch, calls, "cpu", sweep=_sweep(), compile=True, compile_backend="aot_eager")
    graphs = compiled_graphs() - before
    rec = rp.meta["compile"]
    assert set(rec) == {"mode", "backend", "dynamic", "first_s", "recompile_s", "recompiles", "sizes",
                        "recompiled_sizes"}
    assert (rec["mode"], rec["backend"], rec["dynamic"]) == ("default", "aot_eager", "batch")
    assert rec["sizes"] == SIZES and [p.batch_size for p in rp.compute] == SIZES
    # Batch dim dynamic before the first compile: one graph serves all three sizes, counted by dynamo.
    assert graphs >= 1 and rec["recompiles"] == 0 and rec["recompiled_sizes"] == [] and rec["recompile_s"] == 0.0
    assert rec["first_s"] > 0
    # Every step the sweep ran called the compiled module; the one eager call is the optimizer-step timing's
    # gradient (profiler.compute.TimedSteps.optimizer_step_s).
    timed = sum(rp.meta["sweep_repeats"])
    assert calls.kinds.count("compiled") >= timed + len(SIZES)  # + each size's first step (and warm-up)
    assert calls.kinds.count("eager") <= 1
    # The record round-trips through the profile file.
    profile = planner.Profile.from_dict(local_profile([rp]).to_dict(), path="test")
    assert profile.by_rank[0].meta["compile"] == rec


def test_static_shapes_compile_a_graph_per_size_and_record_the_recompile() -> None:
    runner = compile_runner(UserStep(_model(), _batch, _Calls(), "cpu", optimizer_fn=None),
                            CompileOptions(backend="aot_eager", dynamic_batch=False))
    before = compiled_graphs()
    for b in SIZES:
        runner.measure(b, 1, 2)
    runner.measure(SIZES[0], 1, 2)  # a size already run: no new graph, not recorded again
    rec = runner.meta()["compile"]
    assert rec["dynamic"] is None and rec["sizes"] == SIZES
    assert rec["recompiled_sizes"] == SIZES[1:] and rec["recompiles"] >= 2
    assert compiled_graphs() - before == 1 + rec["recompiles"]
    assert rec["recompile_s"] > 0


def test_compile_option_values() -> None:
    assert compile_options(None) is None and compile_options(False) is None
    assert compile_options(True) == CompileOptions(mode="default")
    assert compile_options("max-autotune", "aot_eager") == CompileOptions(mode="max-autotune", backend="aot_eager")
    with pytest.raises(ValidationError, match=r"compile mode 'fast' is not one of torch\.compile's: default, "):
        compile_options("fast")


def test_profile_cli_refuses_an_unknown_compile_mode(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    assert main(["profile", "--model", "mlp", "--compile", "fast", "--out", "unused.json"]) == 2
    assert "argument --compile: invalid choice: 'fast'" in capsys.readouterr().err


def test_the_profile_summary_says_how_each_rank_compiled() -> None:
    from dataclasses import replace
    from pathlib import Path

    from planner.cli.cmd_profile import format_profile

    profile = planner.Profile.load(Path(planner.__file__).parent / "examples" / "minimal_profile.json")
    records = [{"mode": "default", "backend": "inductor", "dynamic": "batch", "first_s": 41.26, "recompile_s": 0.0,
                "recompiles": 0, "sizes": [8, 16, 32], "recompiled_sizes": []},
               {"mode": "default", "backend": "inductor", "dynamic": None, "first_s": 40.0, "recompile_s": 12.34,
                "recompiles": 2, "sizes": [8, 16, 32], "recompiled_sizes": [16, 32]}]
    ranks = tuple(replace(r, meta={**r.meta, "compile": c}) for r, c in zip(profile.ranks, records, strict=True))
    text = format_profile(replace(profile, ranks=ranks))
    assert ("rank 0 compiled (default, inductor, batch dimension dynamic): first step +41.3 s (the compile); "
            "0 graph(s) recompiled over 3 sizes\n") in text
    assert ("rank 1 compiled (default, inductor, batch dimension static): first step +40.0 s (the compile); "
            "2 graph(s) recompiled over 3 sizes, at [16, 32], up to +12.3 s") in text
