"""`planner demo`: the whole pipeline on this machine -- profile, plan, train a little, report.

Each stage runs as its own `planner` command (the ones a user would type), ranks under torchrun, every stage
with a deadline so the demo can never hang.  On a machine without GPUs it uses 2 CPU ranks over gloo and
emulates a 2x slower rank 1, so the plan has something to balance.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from planner.argcheck import check_ranks, count, real
from planner.errors import ValidationError
from planner.lifetime import child_dies_with_parent
from planner.paths import Output, check_outputs

HELP = "profile -> plan -> train -> report on this machine"
EPILOG = """\
examples:
  planner demo                          # 2 local ranks (GPUs if present, else CPU), results in demo-out/
  planner demo --out /tmp/d --nproc 2 --model resnet18 --image-size 64 --emulate-slowdown 1=3
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-out", metavar="DIR", help="folder for profile, plan, log and report")
    p.add_argument("--nproc", type=count(1, 1024), default=2, metavar="N", help="local ranks (default 2)")
    p.add_argument("--device", default="auto", metavar="DEV", help="auto, cpu or cuda (default auto)")
    p.add_argument("--model", default="cifar_cnn", metavar="M", help="model spec (default cifar_cnn)")
    p.add_argument("--image-size", type=count(), default=None, metavar="PX", help="input side for fake data")
    p.add_argument("--global-batch", type=count(), default=64, metavar="B", help="global batch (default 64)")
    p.add_argument("--num-samples", type=count(), default=1024, metavar="N",
                   help="fake dataset length (default 1024)")
    p.add_argument("--epochs", type=count(), default=2, metavar="E", help="training epochs (default 2)")
    p.add_argument("--emulate-slowdown", default="1=2", metavar="R=F,..",
                   help="emulated compute skew (default 1=2; '' for none)")
    p.add_argument("--stage-timeout", type=real(0.0, lo_open=True), default=600.0, metavar="S", help="deadline per stage in seconds")


def _torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "planner"]


def _run_stage(name: str, cmd: list[str], timeout_s: float) -> None:
    print(f"\n== {name}: {shlex.join(cmd)}", flush=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # The stage dies with the demo: SIGTERM to it when the demo ends, even by kill -9 (planner/lifetime.py), and
    # its process group stopped when the demo is interrupted or terminated.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=child_dies_with_parent(signal.SIGTERM))
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_stage(proc)
        raise ValidationError(f"demo stage '{name}' exceeded {timeout_s:.0f} s and was stopped") from None
    except BaseException:  # Ctrl-C, SIGTERM: the stage stops with the demo, before it writes anything more
        _stop_stage(proc)
        raise
    if rc != 0:
        raise ValidationError(f"demo stage '{name}' failed with exit code {rc} (its output is above)")


def _stop_stage(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the stage's process group first (torchrun forwards it to its workers; SIGKILL alone would
    orphan them), SIGKILL after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:  # it had ended
        proc.wait()


def run(args: argparse.Namespace) -> int:
    import torch  # noqa: F401  (fail early, with a clear import error, when torch is missing)

    from profiler.workloads.emulate import parse_rank_floats

    names = ("profile.json", "plan.json", "run.jsonl", "report.html")
    # The folder and the four files in it are checked before the first stage: each stage checks its own output
    # too, but only once the stages before it have run.
    check_outputs([Output(flag="--out", path=args.out, folder=True, files=names)])
    check_ranks(parse_rank_floats(args.emulate_slowdown), args.nproc, "--emulate-slowdown")
    if args.global_batch < args.nproc * 2:  # the demo plans with --min-batch 2 (cifar_cnn has BatchNorm)
        raise ValidationError(f"--global-batch {args.global_batch} cannot give each of {args.nproc} ranks the "
                              f"demo's min batch 2: use --global-batch >= {2 * args.nproc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof, plan, log, report = (out / n for n in names)
    if log.exists():  # the demo's own log from its last run: the trainer refuses to append to a log
        log.unlink()
    common = ["--model", args.model, "--dataset", "fake", "--device", args.device]
    if args.image_size:
        common += ["--image-size", str(args.image_size)]
    emulate = ["--emulate-slowdown", args.emulate_slowdown] if args.emulate_slowdown else []
    t0 = time.perf_counter()
    _run_stage("profile", [*_torchrun(args.nproc), "profile", *common, "--quick", *emulate, "--out", str(prof)],
               args.stage_timeout)
    _run_stage("plan", [sys.executable, "-m", "planner", "plan", "--profile", str(prof), "--global-batch",
                        str(args.global_batch), "--min-batch", "2", "--out", str(plan)], args.stage_timeout)
    _run_stage("train", [*_torchrun(args.nproc), "train", "--plan", str(plan), "--profile", str(prof), "--replan",
                         *common, "--num-samples", str(args.num_samples), "--epochs", str(args.epochs),
                         *emulate, "--log-file", str(log)], args.stage_timeout)
    _run_stage("report", [sys.executable, "-m", "planner", "report", "--profile", str(prof), "--plan", str(plan),
                          "--log", str(log), "--out", str(report)], args.stage_timeout)
    print(f"\ndemo finished in {time.perf_counter() - t0:.0f} s; open the report: {report.resolve()}")
    return 0
