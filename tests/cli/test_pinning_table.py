"""benchmarks/pinning_table.py on session 13's raw files (docs/results, 2x H100): the rows docs/BENCHMARKS.md
section 21 quotes."""

from __future__ import annotations

import json
from pathlib import Path

from tests._scripts import benchmark

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def _hostmon(tag: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / f"h100x2_hostmon_{tag}.jsonl").read_text().splitlines() if line]


def test_a_launch_row_reads_its_clean_epochs_rank_0s_wait_and_the_pool() -> None:
    row = benchmark("pinning_table").row(str(RESULTS / "h100x2_train_auto_replan_s13a_loaderDP_r1"), _hostmon("s13a"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "h100x2_train_auto_replan_s13a_loaderDP_r1" and cells[1] == "[476, 36]"
    assert cells[2] == "0.984, 0.960"  # epochs 1 and 2: epoch 0 holds the fill, epoch 3 the drain
    assert cells[4] == "4.6"  # ms rank 0 waited for data, the DataLoader's own pinning
    assert cells[7] == "55 / 14.2"  # its pool: 55 page-locked blocks, 14.2 GB
    steal, mem = (float(v) for v in cells[8].split(" / "))
    assert 0 <= steal < 0.2 and 90 < mem < 130


def test_a_launch_row_reads_the_compute_tail_and_the_loaders_against_the_plan() -> None:
    """Session 15 call 4 (2x H100, stall emulation), r2: rank 0's compute 97.7 ms in most steps, 108.6 on average
    (long steps); both ranks' workers 13-16% behind the plan, the host 94% busy (section 23)."""
    row = benchmark("pinning_table").row(str(RESULTS / "h100x2_train_auto_replan_s15d_skewS_r2"), [])
    cells = [c.strip() for c in row.strip("|").split("|")]
    median, mean, p90 = (float(v) for v in cells[5].split(" / "))
    assert (median, mean) == (97.7, 108.6) and p90 > 1.2 * median
    assert cells[6] == "1.13, 1.16 / 94%"  # medians over the clean epochs 1-3


def test_without_a_host_monitor_the_host_cell_is_empty() -> None:
    row = benchmark("pinning_table").row(str(RESULTS / "h100x2_train_auto_replan_s13a_loader_r1"), [])
    assert row.rstrip(" |").endswith("-")
