"""`planner demo`: the whole pipeline on this machine -- profile, plan, train a little, report.

Each stage runs as its own `planner` command (the ones a user would type), ranks under torchrun, every stage
with a deadline so the demo can never hang.

The ranks are made unequal on purpose, so the plan has something to balance.  On GPUs rank 1 repeats its compute
(``--emulate-slowdown 1=2``).  On a machine without GPUs the demo's CPU ranks share the host's cores, and there
repeated compute is a poor skew: a loaded box slows both ranks alike and makes every measurement noisy, and a
profile noisier than the plan's predicted gain keeps the equal split.  So on CPU rank 1 pays a fixed cost per
sample instead (``--sample-cost 1=25``: a 25 ms wait per sample in its forward, the demo model's ``SampleCost``),
which the host's load neither changes nor makes noisy, and which leaves the cores to rank 0 while it waits.  A
sample of ``cifar_cnn`` costs about 4.5 ms of compute on an idle core and 10-17 ms on a 2-core box with two busy
processes beside the demo, so the plan's gain over the equal split for 2 ranks, 1 + cost / (2 x compute), is
about 3.8x idle and 1.7-2.1x loaded, while rank 1 still trains 13-30% of the samples.  The profiler sees the cost
as any per-sample cost of a training step: it is inside the measured step.
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
from typing import TYPE_CHECKING

from planner.argcheck import check_ranks, count, real
from planner.errors import ValidationError
from planner.lifetime import child_dies_with_parent
from planner.paths import Output, check_outputs
from profiler.workloads.emulate import parse_rank_floats

if TYPE_CHECKING:
    from torch import nn

HELP = "profile -> plan -> train -> report on this machine"
EPILOG = """\
examples:
  planner demo                          # 2 local ranks (GPUs if present, else CPU), results in demo-out/
  planner demo --out /tmp/d --nproc 2 --model resnet18 --image-size 64 --emulate-slowdown 1=3
  planner demo --device cpu --sample-cost 1=50           # rank 1 waits 50 ms per sample (cifar_cnn only)
"""

SAMPLE_COST_ENV = "PLANNER_DEMO_SAMPLE_MS"
"""How the demo hands ``--sample-cost`` to the ranks of its profile and train stages (``R=MS,..``)."""
DEMO_MODEL = "planner.cli.demo:cifar_cnn_with_sample_cost"
"""The model spec the stages get for ``--model cifar_cnn`` with a sample cost."""
CPU_SAMPLE_COST = "1=25"
GPU_SLOWDOWN = "1=2"


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
    p.add_argument("--emulate-slowdown", default=None, metavar="R=F,..",
                   help=f"emulated compute skew: rank R repeats its compute F times (default {GPU_SLOWDOWN} on GPUs, "
                        "none on CPU; '' for none)")
    p.add_argument("--sample-cost", default=None, metavar="R=MS,..",
                   help=f"rank R waits MS ms per sample in its forward, a skew the host's load does not change "
                        f"(cifar_cnn only; default {CPU_SAMPLE_COST} on CPU, none on GPUs; '' for none)")
    p.add_argument("--stage-timeout", type=real(0.0, lo_open=True), default=600.0, metavar="S", help="deadline per stage in seconds")


def parse_sample_cost(text: str) -> dict[int, float]:
    """``"1=40"`` -> {1: 0.04} (seconds per sample by rank); ValidationError with the expected form."""
    out: dict[int, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        rank, sep, ms = part.partition("=")
        try:
            value = float(ms)
        except ValueError:
            value = -1.0
        if not sep or not rank.strip().isdigit() or not 0.0 <= value <= 10_000.0:
            raise ValidationError(f"--sample-cost: cannot read {part!r}; expected RANK=MS[,RANK=MS..] with MS from 0 "
                                  "to 10000 ms per sample, e.g. --sample-cost 1=40")
        out[int(rank)] = value / 1000.0
    return out


def cifar_cnn_with_sample_cost(num_classes: int = 10) -> nn.Module:
    """The demo's model: ``cifar_cnn`` after a ``SampleCost`` of this rank's seconds per sample (from
    ``PLANNER_DEMO_SAMPLE_MS`` and torchrun's ``RANK``; none when unset)."""
    import torch
    from torch import nn

    from profiler.workloads.specs import build_workload

    cost = parse_sample_cost(os.environ.get(SAMPLE_COST_ENV, "")).get(int(os.environ.get("RANK", "0")), 0.0)
    inner = build_workload("cifar_cnn", "fake", num_samples=1, num_classes=num_classes).model_fn()

    class SampleCost(nn.Module):
        """A fixed wait of ``seconds`` per sample of the batch: time that scales with the batch like compute, but
        uses no core, so the host's load neither slows it nor makes it noisy."""

        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds = seconds

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.seconds > 0:
                time.sleep(self.seconds * x.shape[0])
            return x

    return nn.Sequential(SampleCost(cost), *inner.children()) if cost > 0 else inner


def skew(args: argparse.Namespace, *, on_gpu: bool) -> tuple[str, str]:
    """(``--emulate-slowdown``, ``--sample-cost``) the stages run with: the options as given, else the defaults for
    the device (rank 1 slowed: repeated compute on GPUs, a per-sample cost on CPU; nothing for one rank)."""
    two = args.nproc >= 2
    slowdown = args.emulate_slowdown if args.emulate_slowdown is not None else (GPU_SLOWDOWN if on_gpu and two else "")
    sample_cost = args.sample_cost
    if sample_cost is None:
        sample_cost = CPU_SAMPLE_COST if not on_gpu and two and args.model == "cifar_cnn" else ""
    check_ranks(parse_rank_floats(slowdown), args.nproc, "--emulate-slowdown")
    check_ranks({r: 1.0 for r in parse_sample_cost(sample_cost)}, args.nproc, "--sample-cost")
    if sample_cost and args.model != "cifar_cnn":
        raise ValidationError(f"--sample-cost applies to the demo's cifar_cnn, not --model {args.model}; use "
                              "--emulate-slowdown R=F with another model")
    return slowdown, sample_cost


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
    import torch  # here, not at the top: `planner --help` never imports it (and a missing torch fails early)

    names = ("profile.json", "plan.json", "run.jsonl", "report.html")
    # The folder and the four files in it are checked before the first stage: each stage checks its own output
    # too, but only once the stages before it have run.
    check_outputs([Output(flag="--out", path=args.out, folder=True, files=names)])
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    slowdown, sample_cost = skew(args, on_gpu=on_gpu)
    if args.global_batch < args.nproc * 2:  # the demo plans with --min-batch 2 (cifar_cnn has BatchNorm)
        raise ValidationError(f"--global-batch {args.global_batch} cannot give each of {args.nproc} ranks the "
                              f"demo's min batch 2: use --global-batch >= {2 * args.nproc}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof, plan, log, report = (out / n for n in names)
    if log.exists():  # the demo's own log from its last run: the trainer refuses to append to a log
        log.unlink()
    model = args.model
    if sample_cost:  # the stages' ranks read it from their environment (the model is built there)
        os.environ[SAMPLE_COST_ENV] = sample_cost
        model = DEMO_MODEL
        print(f"emulated skew: --sample-cost {sample_cost} (rank R waits MS ms per sample in its forward)")
    elif slowdown:
        print(f"emulated skew: --emulate-slowdown {slowdown} (rank R repeats its compute F times)")
    common = ["--model", model, "--dataset", "fake", "--device", args.device]
    image_size = args.image_size or (32 if sample_cost else None)  # cifar_cnn's side (a spec's default is 224)
    if image_size:
        common += ["--image-size", str(image_size)]
    emulate = ["--emulate-slowdown", slowdown] if slowdown else []
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
