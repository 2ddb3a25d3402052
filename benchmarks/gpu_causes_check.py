"""Does the report name a real co-tenant as the cause of a slow rank?  (A real co-tenant:
docs/DESIGN.md, Heterogeneity we can produce.)

Usage (one command on a 2-GPU machine; raw JSON, the report and logs go to $OUT, else --out-dir):

    python benchmarks/gpu_causes_check.py --nproc 2 --cotenant-rank 1 --hold-gib 4 --duty 0.8 --model resnet50
    python benchmarks/gpu_causes_check.py --device cpu --nproc 2 --model mlp --budget-s 3   # the pipeline on CPU

1. Starts benchmarks/cotenant.py on cuda:<cotenant-rank> (a bf16 matmul loop busy ``--duty`` of the time, holding
   ``--hold-gib`` GiB) in a session of its own, like another user's job, and waits until it holds its memory.
2. Profiles every rank with the product's own command under torchrun (``planner profile``, loader skipped).
3. Stops the co-tenant, then renders ``planner report`` (terminal summary, HTML, --json).
4. Checks that the report has a finding for the co-tenant's rank whose evidence names one other process on the
   GPU, its pid (when NVML's pids are this namespace's) and at least 90% of the memory it held -- in the terminal
   summary, the HTML and the JSON -- and that the other rank shows no other process.  Writes cotenant_check.json;
   exits 1 when a check fails.

On CPU there is no NVML: the same pipeline runs (the co-tenant burns a core) and only the report is checked.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="rank devices (default cuda)")
    p.add_argument("--nproc", type=int, default=2, help="ranks under torchrun (default 2)")
    p.add_argument("--cotenant-rank", type=int, default=1, help="rank whose device gets the co-tenant (default 1)")
    p.add_argument("--duty", type=float, default=0.8, help="co-tenant busy fraction (default 0.8)")
    p.add_argument("--hold-gib", type=float, default=4.0, help="GiB the co-tenant holds (default 4)")
    p.add_argument("--model", default="resnet50", help="model spec (default resnet50)")
    p.add_argument("--image-size", type=int, default=None, help="input side in pixels (default per model)")
    p.add_argument("--budget-s", type=float, default=20.0, help="compute sweep seconds per rank (default 20)")
    p.add_argument("--global-batch", type=int, default=512, help="global batch of the report (default 512)")
    p.add_argument("--out-dir", default=None, help="where results go (default $OUT, else ./cotenant-out)")
    p.add_argument("--timeout-s", type=float, default=480.0, help="limit for the profile run (default 480)")
    return p


def start_cotenant(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    device = f"cuda:{args.cotenant_rank}" if args.device == "cuda" else "cpu"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cotenant.py"), "--device", device, "--duty", str(args.duty),
           "--hold-gib", str(args.hold_gib if args.device == "cuda" else 0.0)]
    with open(log, "wb") as err:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # its first line says it holds its memory and runs
        text = log.read_text(errors="replace")
        if "cotenant pid" in text:
            return proc, proc.pid
        if proc.poll() is not None:
            raise RuntimeError(f"the co-tenant exited with {proc.returncode}: {text[-2000:]}")
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError("the co-tenant did not start within 120 s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(cmd: list[str], log: Path, timeout_s: float) -> int:
    """Run a command with its output in `log`; on timeout its whole process group is ended."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124


REQUIRED_GPU = ("rank_is_slow", "one_other_process", "its_pid", "its_memory", "cause_is_the_cotenant",
                "finding_names_pid", "finding_names_memory", "in_terminal", "in_html", "other_ranks_alone")


def check_report(report: dict[str, Any], summary: str, page: str, *, rank: int, pid: int, hold_bytes: int,
                 gpu: bool) -> dict[str, Any]:
    """Every check of step 4, by name -> bool, plus the finding's text (None when the report has none)."""
    causes = report.get("causes") or {}
    slow = [s for s in causes.get("slow_ranks", []) if s["rank"] == rank and s["source"] == "profile"]
    finding = slow[0] if slow else None
    text = finding["text"] if finding else None
    checks: dict[str, Any] = {"finding": text, "rank_is_slow": finding is not None}
    if not gpu:  # an unpinned CPU co-tenant need not slow one rank more than the other: only the pipeline is checked
        checks["report_has_causes"] = "causes" in report
        return checks
    states = causes.get("states") or []
    mine = states[rank] if rank < len(states) and states[rank] else {}
    others = mine.get("other_processes") or []
    foreign = bool(mine.get("own_pid_by_memory"))
    held = sum(p.get("used_bytes") or 0 for p in others)
    co = [e for e in (finding or {}).get("evidence", []) if e["kind"] == "co-tenant" and e["explains"]]
    checks.update({
        "one_other_process": len(others) == 1,
        "its_pid": foreign or any(p["pid"] == pid for p in others),
        "pids_from_another_namespace": foreign,
        "its_memory": held >= 0.9 * hold_bytes,
        "other_process_gib": round(held / 2**30, 2),
        "cause_is_the_cotenant": bool(co),
        "finding_names_pid": text is not None and (foreign or f"pid {pid}" in text),
        "finding_names_memory": text is not None and "GiB" in text and "other process on the GPU" in text,
        "in_terminal": text is not None and text in summary,
        "in_html": bool(co) and html.escape(co[0]["text"], quote=True) in page,
        "other_ranks_alone": all((s or {}).get("other_processes") == [] for i, s in enumerate(states) if i != rank),
    })
    return checks


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    out = Path(args.out_dir or os.environ.get("OUT") or "cotenant-out")
    out.mkdir(parents=True, exist_ok=True)
    gpu = args.device == "cuda"
    profile, report_json, page_path = out / "profile.json", out / "report.json", out / "report.html"
    proc, pid = start_cotenant(args, out / "cotenant.log")
    try:
        time.sleep(3)  # the co-tenant's loop is running before the first rank measures
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               "-m", "planner", "profile", "--model", args.model, "--device", "auto" if gpu else "cpu",
               "--budget-s", str(args.budget_s), "--no-loader", "--out", str(profile)]
        cmd += (["--amp"] if gpu else ["--quick"]) + (["--image-size", str(args.image_size)] if args.image_size else [])
        t0 = time.monotonic()
        rc = run(cmd, out / "profile.log", args.timeout_s)
        profile_s = time.monotonic() - t0
    finally:
        stop(proc)
    if rc != 0:
        print(f"planner profile failed (exit {rc}); see {out / 'profile.log'}", file=sys.stderr)
        return 1
    rc = run([sys.executable, "-m", "planner", "report", "--profile", str(profile), "--global-batch",
              str(args.global_batch), "--out", str(page_path), "--json", str(report_json)], out / "report.txt", 300)
    if rc != 0:
        print(f"planner report failed (exit {rc}); see {out / 'report.txt'}", file=sys.stderr)
        return 1
    report = json.loads(report_json.read_text())
    summary, page = (out / "report.txt").read_text(), page_path.read_text()
    checks = check_report(report, summary, page, rank=args.cotenant_rank, pid=pid,
                          hold_bytes=int(args.hold_gib * 2**30), gpu=gpu)
    required = REQUIRED_GPU if gpu else ("report_has_causes",)
    passed = all(checks[k] for k in required)
    prof = json.loads(profile.read_text())
    doc = {
        "kind": "cotenant_check", "passed": passed, "checks": checks,
        "cotenant": {"pid": pid, "rank": args.cotenant_rank, "duty": args.duty, "hold_gib": args.hold_gib},
        "model": args.model, "device": args.device, "nproc": args.nproc, "profile_s": round(profile_s, 1),
        "ranks": [{"rank": r["rank"], "device_name": r.get("device_name"),
                   "best_samples_per_s": max(p["batch_size"] / p["step_time_s"] for p in r["compute"]),
                   "device_state": r.get("device_state")} for r in prof["ranks"]],
        "findings": report["findings"]["lines"],
        "meta": {k: prof.get("meta", {}).get(k) for k in ("torch", "cuda", "python", "platform")},
    }
    (out / "cotenant_check.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{'PASS' if passed else 'FAIL'}: " + "; ".join(f"{k}={v}" for k, v in checks.items() if k != "finding"))
    print(f"finding: {checks['finding']}")
    print(f"wrote {out / 'cotenant_check.json'}, {page_path}, {report_json}, {profile}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
