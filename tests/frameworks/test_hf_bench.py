"""benchmarks/hf_gpu.py's logic on CPU (--tiny): profile + plan through profiler.api, the HF Trainer's default and
the planned twin in interleaved rounds, and the raw JSON the GPU run writes. Speed is not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.frameworks._common import REPO, torchrun

pytest.importorskip("transformers")


@pytest.mark.distributed
def test_hf_gpu_benchmark_runs_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "hf_gpu.json"
    rc, text, err = torchrun(REPO / "benchmarks" / "hf_gpu.py",
                             ["--tiny", "--factors", "3", "--json", str(out), "--tmp", str(tmp_path)], timeout_s=180)
    assert rc == 0, err[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["args"]["seq_len"] == 64
    plan = res["setups"]["3"]["plan"]
    sizes = [r["batch_size"] for r in plan["ranks"]]
    # What the profile makes of rank 1 depends on this host's load (speed is not asserted here): a valid split.
    assert sum(sizes) == 8 and min(sizes) >= 1
    (row,) = res["rounds"]
    for variant in ("default", "planned", "planned-equal"):
        assert row[variant]["samples_per_s"] > 0
        assert row[variant]["tokens_per_s"] == pytest.approx(64 * row[variant]["samples_per_s"])
    # the planned trainer also runs the equal split, to show the adapter's cost apart from the split's
    assert [r["batch_size"] for r in res["setups"]["3"]["equal_plan"]["ranks"]] == [4, 4]
    summary = res["summary"]["3"]
    assert summary["plan_batch_sizes"] == sizes and "prediction_error" in summary
    assert summary["planned_equal_vs_default"] > 0 and "planned_equal_prediction_error" in summary
    assert "planned / HF default" in text
