"""Does re-planning follow a rank that slows mid-run?  N launches of each of two forms, scored from their run logs.

Forms (both start from one plan solved from a profile of the un-slowed ranks, and re-plan at every epoch end):

  own    docs/ADOPTING.md's own DDP loop on runtime.PlannedRun (benchmarks/_midrun_own_loop.py)
  train  `planner train --replan`, slowed by its own --emulate-slowdown options

Cases (``--case``; ``--device cuda`` picks a GPU one):

  cpu             2 gloo ranks on CPU, cifar_cnn on inputs held in memory; rank 1 emulated 4x slower from epoch 2
                  (Slowdown: 3 extra forward+backward passes a step through torch.autograd.grad on the unwrapped
                  module -- the mechanism of `planner train --emulate-slowdown`, used by both forms)
  cuda-cpu        rank 0 on cuda:0 beside rank 1 on CPU (gloo, which copies the CUDA tensors; NCCL cannot span a
                  CPU), an MLP small enough that the CPU rank takes a real share; real heterogeneity only: a
                  co-tenant (benchmarks/cotenant.py) joins the GPU from epoch 3
  shared-gpu-hog  two ranks sharing cuda:0 over gloo, a loader-bound ResNet-50 (bf16) on FakeData through the real
                  PIL pipeline in DataLoader workers; each rank pinned to its own half of the cores, 2 of them for
                  its training process and the rest for its workers; a CPU hog (one busy cotenant.py process per
                  core) on rank 1's loader cores from epoch 3

Per launch, from the run log: the batch sizes and samples/s of every epoch; the adopt delay (the first epoch that
runs a split adopted at or after the disturbance's first epoch, less that epoch: 1 when the first epoch-end that
saw it moved the split; must be <= 2); reversals (a revert record, or an adoption that brings the split closer to
one it had left); oscillation (a split run, left and run again); a crash (rc != 0 or the timeout); the median
samples/s of the last 3 epochs (disturbed ones: none with fewer) against the best epoch-level samples/s any launch of the form measured under the
disturbance (must be >= 0.9), and against the best split's typical epoch (the split whose disturbed epochs, over
every launch of the form, have the highest median samples/s, over 3 or more of them; the first disturbed epoch left
out: it ran the split from before the disturbance); beside the plan's split, the throughput-proportional one (each rank's share
proportional to its measured samples per busy second in the disturbance's first epoch), and the equal split's
samples/s in the disturbed epochs that ran it; the settled prediction error: from the second epoch after the last
adoption under the disturbance on, each epoch's measured step / the prediction in force - 1 (the plan the previous
epoch's decision left), its median (must be within 5% on a GPU case) and worst.  A table goes to stdout and one record per launch to
``--results`` as ``<cards>_<model>_replan-midrun[-<case>]-<form>_NN.json``; raw logs stay in a temporary folder
(``--keep`` prints it and keeps it).

Every launch runs under a timeout and is killed (each rank's process group) on expiry; a crashed launch is
scored, never fatal.  Ranks are started here with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), which lets each have its own cores and a kill reach all of it.

examples:
  python benchmarks/replan_midrun.py                                  # CPU acceptance: 5 launches of each form
  python benchmarks/replan_midrun.py --launches 1 --epochs 4 --results /tmp/rm   # a smoke test
  python benchmarks/replan_midrun.py --device cuda --case cuda-cpu            # one H200 beside its CPU
  python benchmarks/replan_midrun.py --device cuda --case shared-gpu-hog      # two ranks on one H200, CPU hog
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from summarize_bench import card_tag  # benchmarks/ is this script's folder: the records' one naming

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
OWN_LOOP = Path(__file__).resolve().parent / "_midrun_own_loop.py"
COTENANT = Path(__file__).resolve().parent / "cotenant.py"
FORMS = ("own", "train")
MAX_ADOPT_DELAY = 2
MIN_OF_BEST = 0.9
MAX_PREDICTION_ERROR = 0.05
LAST_EPOCHS = 3


@dataclass(frozen=True, kw_only=True)
class Case:
    """One setting: devices, workload, and what goes wrong mid-run."""

    name: str
    devices: tuple[str, ...]
    """One device per rank."""
    model: str
    global_batch: int
    num_samples: int
    """Samples per epoch (>= 20 steps: the Replanner's min_steps and warm-up are met with room)."""
    data: str = "synthetic"
    """synthetic: inputs held in memory (`planner train --data-on-device`); pipeline: the dataset in workers."""
    image_size: int | None = None
    amp: bool = False
    slow_rank: int = 1
    slow_factor: float = 1.0
    """Emulated compute multiplier of slow_rank from from_epoch (1: no emulation)."""
    from_epoch: int = 2
    """The first disturbed epoch."""
    cotenant: str | None = None
    """Device a cotenant.py process loads from from_epoch (cuda:0), or "cpu-hog": one busy process per core of
    slow_rank's cores."""
    cotenant_duty: float = 0.8
    pin_cores: bool = False
    """Each rank (its loader workers too) on its own share of this process's cores."""
    threads: tuple[int, ...] = (1, 1)
    """OMP threads per rank (0: that rank's share of the cores)."""
    main_cores: int = 0
    """With pin_cores, own form: each rank's first this many cores run its training process (its gloo threads too),
    the rest its loader workers, and a cpu-hog takes only the slow rank's loader cores -- the loader slows, the
    all-reduce (reduced on the CPU by gloo) does not.  0: one set of cores for both (the train form always)."""
    launches: int = 5
    launch_timeout_s: float = 420.0
    budget_s: float | None = None
    """Start no launch the longest so far would carry past this many seconds from the start (GPU cases)."""
    profile_args: tuple[str, ...] = ()

    @property
    def heterogeneity(self) -> str:
        if self.slow_factor > 1:
            return f"emulated compute skew {self.slow_rank}={self.slow_factor:g} from epoch {self.from_epoch}"
        if self.cotenant == "cpu-hog":
            return f"real: CPU hog on rank {self.slow_rank}'s loader cores from epoch {self.from_epoch}"
        return (f"real: {'CUDA + CPU ranks, ' if 'cpu' in self.devices else ''}co-tenant on {self.cotenant} "
                f"(duty {self.cotenant_duty:g}) from epoch {self.from_epoch}")


CASES = {
    # 24 steps of 32 an epoch: cifar_cnn at 16 samples is 45-90 ms a step on one core of this 2-core box.
    # Each rank on a core of its own: the slow rank's extra passes must not take the other's core.
    "cpu": Case(name="cpu", devices=("cpu", "cpu"), model="cifar_cnn", global_batch=32, num_samples=768,
                slow_factor=4.0, pin_cores=True, profile_args=("--dataset", "fake", "--no-loader", "--batch-sizes", "8,16,24,32")),
    # The GPU's step is launch-bound at these batches, so the CPU rank's share is real; 60 steps an epoch.
    "cuda-cpu": Case(name="cuda-cpu", devices=("cuda:0", "cpu"), model="mlp", global_batch=512, num_samples=30720,
                     from_epoch=3, slow_rank=0, cotenant="cuda:0", pin_cores=True, threads=(2, 0), launches=1,
                     launch_timeout_s=150.0, budget_s=225.0,
                     profile_args=("--dataset", "fake", "--no-loader", "--quick")),
    # 40 steps of 128 an epoch; each rank on 8 cores of 16 (2 for the training process, 6 for its loader workers),
    # the hog on rank 1's loader cores.
    "shared-gpu-hog": Case(name="shared-gpu-hog", devices=("cuda:0", "cuda:0"), model="resnet50", global_batch=128,
                           num_samples=5120, data="pipeline", amp=True, from_epoch=3, cotenant="cpu-hog",
                           cotenant_duty=1.0, pin_cores=True, threads=(2, 2), main_cores=2, launches=1,
                           launch_timeout_s=180.0,
                           budget_s=225.0, profile_args=("--dataset", "fake", "--quick", "--amp")),
}


# -- launching --------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_cores(case: Case) -> list[set[int] | None]:
    """Each rank's cores when the case pins: this process's cores cut into equal consecutive shares."""
    if not case.pin_cores or not hasattr(os, "sched_getaffinity"):
        return [None] * len(case.devices)
    cores = sorted(os.sched_getaffinity(0))
    n = len(case.devices)
    if len(cores) < n:
        return [None] * n
    share = len(cores) // n
    return [set(cores[i * share:(i + 1) * share]) for i in range(n)]


def hog_cores(case: Case, cores: list[set[int] | None]) -> list[int]:
    """The cores a cpu-hog takes: the slow rank's, less those its training process runs on (``main_cores``)."""
    return sorted(cores[case.slow_rank] or os.sched_getaffinity(0))[case.main_cores:]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"), NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
               PYTHONUNBUFFERED="1")
    return env


def _pinned(cores: set[int] | None) -> Any:
    # Runs in the child before exec: its loader workers inherit the affinity.
    return None if cores is None else (lambda: os.sched_setaffinity(0, cores))


@dataclass
class Group:
    """Processes that each lead a process group of their own (start_new_session), so a kill reaches their
    children (loader workers) too."""

    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, cmd: Sequence[str], env: dict[str, str], out: Path, cores: set[int] | None = None) -> None:
        with open(out, "wb") as f:  # the child holds its own descriptor
            self.procs.append(subprocess.Popen(list(cmd), env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                               start_new_session=True, preexec_fn=_pinned(cores)))

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                with _quiet():
                    os.killpg(p.pid, sig)
        end = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in self.procs:  # leftovers of a group whose leader is gone (a worker)
            with _quiet():
                os.killpg(p.pid, signal.SIGKILL)


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, *rest: object) -> bool:
        return isinstance(kind, type) and issubclass(kind, ProcessLookupError | PermissionError)


def run_ranks(cmds: list[list[str]], envs: list[dict[str, str]], cores: list[set[int] | None], logs: Path,
              timeout_s: float, *, watch: Path | None = None, at_epoch: int | None = None,
              on_epoch: Any = None) -> tuple[int, bool, float]:
    """Run one command per rank; (rc, timed out, wall s).  rc is the first nonzero exit, or 0.  A rank that fails
    ends the launch (its peers would wait on it until the gloo timeout).  With ``watch``, ``on_epoch()`` is called
    once the run log there holds the epoch record of ``at_epoch - 1``: the next epoch has begun."""
    group = Group()
    t0 = time.monotonic()
    fired = at_epoch is None
    try:
        for r, (cmd, env) in enumerate(zip(cmds, envs, strict=True)):
            group.start(cmd, env, logs / f"rank{r}.out", cores[r])
        while True:
            codes = [p.poll() for p in group.procs]
            if all(c is not None for c in codes):
                return next((c for c in codes if c), 0), False, time.monotonic() - t0
            if any(c for c in codes if c is not None):
                time.sleep(3.0)  # the peer's own error usually follows; then it is stopped
                codes = [p.poll() for p in group.procs]
                return next(c for c in codes if c), False, time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                return 124, True, time.monotonic() - t0
            if not fired and watch is not None and at_epoch is not None and _has_epoch(watch, at_epoch - 1):
                fired = True
                on_epoch()
            time.sleep(0.05)
    finally:
        group.stop()


def _has_epoch(log: Path, epoch: int) -> bool:
    try:
        text = log.read_text(encoding="utf-8")
    except OSError:
        return False
    for line in text.splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue  # the line being written
        if isinstance(d, dict) and d.get("event") == "epoch" and d.get("epoch") == epoch:
            return True
    return False


class Disturbance:
    """The case's co-tenant: started (set up, waiting on a start file) before the launch, loading its device from
    ``fire()`` on, stopped with the launch."""

    def __init__(self, case: Case, cores: list[set[int] | None], tmp: Path) -> None:
        self.case, self.group, self.start_file = case, Group(), tmp / "cotenant.go"
        self.start_file.unlink(missing_ok=True)
        self.fired_at: float | None = None
        env = base_env()
        env["OMP_NUM_THREADS"] = "1"
        base = [sys.executable, str(COTENANT), "--duty", f"{case.cotenant_duty:g}", "--start-file",
                str(self.start_file)]
        if case.cotenant == "cpu-hog":
            for c in hog_cores(case, cores):
                self.group.start([*base, "--device", "cpu"], env, tmp / f"hog{c}.out", {c})
        elif case.cotenant is not None:
            self.group.start([*base, "--device", case.cotenant], env, tmp / "cotenant.out")

    def fire(self) -> None:
        self.start_file.touch()
        self.fired_at = time.time()

    def stop(self) -> None:
        self.group.stop()


def rank_envs(case: Case, cores: list[set[int] | None]) -> list[dict[str, str]]:
    port = str(free_port())
    n = len(case.devices)
    out = []
    for r in range(n):
        env = base_env()
        threads = case.threads[r] or len(cores[r] or os.sched_getaffinity(0))
        env.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n), GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS=str(threads))
        out.append(env)
    return out


# -- the commands -----------------------------------------------------------------------------------------------------
def own_command(case: Case, epochs: int, plan: Path, profile: Path, log: Path, seed: int) -> list[str]:
    cmd = [sys.executable, str(OWN_LOOP), "--plan", str(plan), "--profile", str(profile), "--log-file", str(log),
           "--model", case.model, "--num-samples", str(case.num_samples), "--epochs", str(epochs),
           "--devices", ",".join(case.devices), "--data", case.data, "--seed", str(seed),
           "--slow-rank", str(case.slow_rank), "--slow-factor", f"{case.slow_factor:g}",
           "--slow-from-epoch", str(case.from_epoch)]
    if case.image_size:
        cmd += ["--image-size", str(case.image_size)]
    if case.amp:
        cmd.append("--amp")
    if case.data == "pipeline" and all(d.startswith("cuda") for d in case.devices):
        cmd.append("--gpu-normalize")  # as planner train (and the profile) do on all-CUDA ranks
    if case.main_cores and case.pin_cores:
        cmd += ["--main-cores", str(case.main_cores)]
    return cmd


def train_command(case: Case, epochs: int, plan: Path, profile: Path, log: Path, seed: int) -> list[str]:
    cmd = [sys.executable, "-m", "planner", "train", "--plan", str(plan), "--profile", str(profile), "--replan",
           "--model", case.model, "--num-samples", str(case.num_samples), "--epochs", str(epochs),
           "--rank-devices", ",".join(case.devices), "--log-file", str(log), "--seed", str(seed), "--quiet"]
    if case.slow_factor > 1:
        cmd += ["--emulate-slowdown", f"{case.slow_rank}={case.slow_factor:g}",
                "--emulate-slowdown-from-epoch", str(case.from_epoch)]
    if case.data == "synthetic":
        cmd.append("--data-on-device")
    if case.image_size:
        cmd += ["--image-size", str(case.image_size)]
    if case.amp:
        cmd.append("--amp")
    return cmd


def make_plan(case: Case, tmp: Path, timeout_s: float) -> tuple[Path, Path, str]:
    """The profile of the un-slowed ranks and the plan solved from it (one for every launch); (profile, plan, the
    commands as run)."""
    profile, plan = tmp / "profile.json", tmp / "plan.json"
    common = [sys.executable, "-m", "planner", "profile", "--model", case.model, *case.profile_args,
              "--out", str(profile), "--quiet"]
    if case.image_size:
        common += ["--image-size", str(case.image_size)]
    cores = rank_cores(case)
    if len(set(case.devices)) == len(case.devices) or "cpu" in case.devices:
        # Every rank's device profiled in turn in one process (nothing else loads the box meanwhile).
        cmd = [*common, "--devices", ",".join(case.devices)]
        env = base_env()
        env["OMP_NUM_THREADS"] = str(max(case.threads[i] or len(cores[i] or os.sched_getaffinity(0))
                                         for i in range(len(case.devices))))
        rc, timed_out, _ = run_ranks([cmd], [env], [None], tmp, timeout_s)
    else:
        # Ranks sharing a device: profiled together, as they will train (each on its cores).
        cmd = [*common, "--device", case.devices[0]]
        rc, timed_out, _ = run_ranks([cmd] * len(case.devices), rank_envs(case, cores), cores, tmp, timeout_s)
    if rc != 0:
        tail = (tmp / "rank0.out").read_text(errors="replace")[-3000:]
        raise SystemExit(f"profile failed (rc {rc}{', timed out' if timed_out else ''}):\n{tail}")
    solve = [sys.executable, "-m", "planner", "plan", "--profile", str(profile), "--global-batch",
             str(case.global_batch), "--out", str(plan)]
    done = subprocess.run(solve, env=base_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise SystemExit(f"planner plan failed:\n{done.stdout}{done.stderr}")
    return profile, plan, f"{shlex.join(cmd)} && {shlex.join(solve)}"


# -- scoring ----------------------------------------------------------------------------------------------------------
@dataclass
class Launch:
    form: str
    index: int
    command: str
    rc: int
    timed_out: bool
    wall_s: float
    epochs: list[dict[str, Any]]
    decisions: list[dict[str, Any]]
    disturbance_at_epoch: int | None = None
    """The epoch running when the co-tenant was started (None: emulated, or never started)."""
    scores: dict[str, Any] = field(default_factory=dict)
    tail: str = ""

    @property
    def crashed(self) -> bool:
        return self.rc != 0


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float | None]:
    """(epoch records, decision records, the start plan's predicted step) of the run log's last run, as raw dicts
    (a killed run's last line is skipped)."""
    epochs: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    start: float | None = None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return epochs, decisions, start
    for line in lines:
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if not isinstance(d, dict):
            continue
        if d.get("event") == "start":
            epochs, decisions = [], []
            start = ((d.get("plan") or {}).get("predicted") or {}).get("step_time_s")
        elif d.get("event") == "epoch":
            epochs.append(d)
        elif d.get("event") in ("replan", "revert"):
            decisions.append(d)
    return epochs, decisions, start


def prediction_errors(epochs: Sequence[dict[str, Any]], decisions: Sequence[dict[str, Any]],
                      start_step_s: float | None) -> dict[int, float]:
    """Per epoch, its measured step / the prediction in force - 1: the step time of the plan the previous epoch's
    decision left (adopted, reverted to, or kept with its prediction re-made; the start plan's before any)."""
    in_force = start_step_s
    by_epoch = {int(d["epoch"]): d for d in decisions}
    out: dict[int, float] = {}
    for e in sorted(epochs, key=lambda e: int(e["epoch"])):
        step = e.get("step_time_s")
        if in_force and step:
            out[int(e["epoch"])] = step / in_force - 1.0
        plan = (by_epoch.get(int(e["epoch"])) or {}).get("plan")
        if plan and (plan.get("predicted") or {}).get("step_time_s"):
            in_force = plan["predicted"]["step_time_s"]
    return out


def _l1(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True))


def proportional_split(epoch: dict[str, Any], global_batch: int, min_batch: int) -> list[int] | None:
    """Each rank's share of the global batch proportional to its measured samples per busy second (compute and
    the wait for its data: a loader-bound rank is as slow as its loader) in this epoch; largest remainders."""
    speeds = []
    for st in sorted(epoch.get("ranks") or [], key=lambda s: s["rank"]):
        busy = (st.get("compute_s") or 0.0) + (st.get("data_wait_s") or 0.0)
        if not busy or busy <= 0 or not st.get("batch_size"):
            return None
        speeds.append(st["batch_size"] / busy)
    if not speeds:
        return None
    free = global_batch - min_batch * len(speeds)
    exact = [free * s / sum(speeds) for s in speeds]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: exact[i] - out[i], reverse=True)[:free - sum(out)]:
        out[i] += 1
    return [min_batch + x for x in out]


def score(la: Launch, first_disturbed: int, global_batch: int, min_batch: int,
          start_step_s: float | None = None) -> dict[str, Any]:
    """The launch's own scores (the ratio to the form's best is added once every launch of the form ran)."""
    splits = [tuple(e["batch_sizes"]) for e in la.epochs]
    # Runs of one split, in order: a split that comes back after another ran between is an oscillation.
    runs = [s for i, s in enumerate(splits) if i == 0 or s != splits[i - 1]]
    oscillation = len(runs) != len(set(runs))
    reversals = 0
    for k in range(1, len(runs)):  # an adoption that comes closer to a split it had left
        if any(_l1(runs[k], runs[j]) < _l1(runs[k - 1], runs[j]) for j in range(k - 1)):
            reversals += 1
    reverts = [d for d in la.decisions if d.get("event") == "revert"]
    reversals = max(reversals, len(reverts))
    adopted = [d for d in la.decisions if d.get("adopted") and d.get("event") != "revert"]
    late = [d for d in adopted if int(d["epoch"]) >= first_disturbed]
    delay = int(late[0]["epoch"]) + 1 - first_disturbed if late else None
    disturbed = [e for e in la.epochs if int(e["epoch"]) >= first_disturbed]
    # The last epochs under the disturbance only: a short run's last 3 would mix in an undisturbed one.
    last = [e["samples_per_s"] for e in disturbed[-LAST_EPOCHS:] if e.get("samples_per_s")]
    equal = [global_batch // len(splits[0])] * len(splits[0]) if splits else []
    equal_sps = [e["samples_per_s"] for e in disturbed if list(e["batch_sizes"]) == equal and e.get("samples_per_s")]
    # The prediction from the second epoch after the last adoption under the disturbance on (the first one runs
    # the new split's first epoch, which the decision after it learns from): median and worst |error|.
    errors = prediction_errors(la.epochs, la.decisions, start_step_s)
    settled = [errors[e] for e in sorted(errors) if late and e >= int(late[-1]["epoch"]) + 2]
    pred_median = statistics.median(settled) if settled else None
    return {
        "crashed": la.crashed, "rc": la.rc, "timed_out": la.timed_out, "epochs_logged": len(la.epochs),
        "adopted_epochs": [int(d["epoch"]) for d in adopted],
        "adopt_delay_epochs": delay, "adopt_delay_ok": delay is not None and delay <= MAX_ADOPT_DELAY,
        "reversals": reversals, "reverts": len(reverts), "oscillation": oscillation,
        "last3_median_samples_per_s": statistics.median(last) if len(last) == LAST_EPOCHS else None,
        "best_disturbed_samples_per_s": max((e["samples_per_s"] for e in disturbed if e.get("samples_per_s")),
                                            default=None),
        "proportional_split": proportional_split(disturbed[0], global_batch, min_batch) if disturbed else None,
        "split_in_proportional_epoch": list(disturbed[0]["batch_sizes"]) if disturbed else None,
        "final_split": list(splits[-1]) if splits else None,
        "equal_split_disturbed_samples_per_s": equal_sps,
        "prediction_errors": {str(k): round(v, 4) for k, v in errors.items()},
        "prediction_error_settled_median": pred_median,
        "prediction_error_settled_max_abs": max((abs(x) for x in settled), default=None),
        "prediction_ok": pred_median is not None and abs(pred_median) <= MAX_PREDICTION_ERROR,
    }


def score_form(launches: list[Launch], case: Case) -> None:
    """The form's best disturbed epoch over every launch, and each launch's last-3 median against it.  A launch
    passes with no crash, an adoption within ``MAX_ADOPT_DELAY`` epochs, no oscillation, and on CPU its last-3
    median at least ``MIN_OF_BEST`` of the best, on a GPU case its settled prediction within
    ``MAX_PREDICTION_ERROR`` (what each case's acceptance asks)."""
    best = max((la.scores["best_disturbed_samples_per_s"] or 0.0 for la in launches), default=0.0)
    # The best split by its typical epoch, not its luckiest: per split, the median samples/s of every disturbed
    # epoch any launch ran on it after the disturbance's first (which ran the split from before it).
    by_split: dict[tuple[int, ...], list[float]] = {}
    for la in launches:
        start = la.disturbance_at_epoch if la.disturbance_at_epoch is not None else case.from_epoch
        for e in la.epochs:
            if int(e["epoch"]) > start and e.get("samples_per_s"):
                by_split.setdefault(tuple(e["batch_sizes"]), []).append(e["samples_per_s"])
    typical = {k: statistics.median(v) for k, v in by_split.items() if len(v) >= LAST_EPOCHS}  # a median of 3+
    best_split = max(typical, key=lambda k: typical[k]) if typical else None
    for la in launches:
        med = la.scores["last3_median_samples_per_s"]
        ratio = med / best if med and best else None
        la.scores.update(form_best_samples_per_s=best or None, of_best=ratio,
                         of_best_ok=ratio is not None and ratio >= MIN_OF_BEST,
                         best_split=list(best_split) if best_split else None,
                         best_split_median_samples_per_s=typical.get(best_split) if best_split else None,
                         of_best_split=(med / typical[best_split] if med and best_split else None),
                         best_split_epochs=len(by_split.get(best_split, [])) if best_split else 0)
        wanted = la.scores["of_best_ok"] if case.name == "cpu" else la.scores["prediction_ok"]
        la.scores["pass"] = (not la.crashed and la.scores["adopt_delay_ok"] and wanted
                             and not la.scores["oscillation"])


# -- records and the table ----------------------------------------------------------------------------------------------
def write_record(la: Launch, case: Case, meta: dict[str, Any], out: Path) -> Path:
    scenario = f"replan-midrun-{la.form}" if case.name == "cpu" else f"replan-midrun-{case.name}-{la.form}"
    stem = f"{card_tag(meta['devices'])}_{case.model}_{scenario}"
    out.mkdir(parents=True, exist_ok=True)
    n = 1
    while (out / f"{stem}_{n:02d}.json").exists():
        n += 1
    rec = {
        "record": 1, "kind": "replan-midrun", "case": case.name, "form": la.form, "launch": la.index,
        "source": f"{la.form}_{la.index}/run.jsonl (temporary; not kept)", "command": la.command,
        "meta": {**meta, "heterogeneity": case.heterogeneity},
        "epochs": [{"epoch": e["epoch"], "batch_sizes": e["batch_sizes"], "samples_per_s": e.get("samples_per_s"),
                    "step_time_s": e.get("step_time_s"),
                    "disturbed": int(e["epoch"]) >= (la.disturbance_at_epoch if la.disturbance_at_epoch is not None
                                                     else case.from_epoch)} for e in la.epochs],
        "decisions": [{"epoch": d["epoch"], "event": d.get("event"), "adopted": d.get("adopted"),
                       "new_batch_sizes": d.get("new_batch_sizes"), "reason": str(d.get("reason", "")).split("\n")[0]}
                      for d in la.decisions],
        "scores": la.scores, "wall_s": round(la.wall_s, 1),
    }
    path = out / f"{stem}_{n:02d}.json"
    path.write_text(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n", encoding="utf-8")
    return path


def _f(x: Any, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(launches: list[Launch], from_epoch: int) -> str:
    rows = ["| form | launch | rc | adopt delay | reversals | oscillation | last-3 median samples/s | x best | "
            "x best split's median | "
            "settled prediction error | plan split (first disturbed epoch) | proportional | final split | "
            "equal split disturbed samples/s | pass |", "|" + "---|" * 15]
    for la in launches:
        s = la.scores
        rows.append(
            f"| {la.form} | {la.index} | {la.rc}{' (timeout)' if la.timed_out else ''} | "
            f"{_f(s['adopt_delay_epochs'], 'd')} | {s['reversals']} | {'yes' if s['oscillation'] else 'no'} | "
            f"{_f(s['last3_median_samples_per_s'])} | {_f(s['of_best'], '.3f')} | "
            f"{_f(s.get('of_best_split'), '.3f')} {s.get('best_split')} | "
            f"{_f(s['prediction_error_settled_median'], '+.1%')} (max {_f(s['prediction_error_settled_max_abs'], '.1%')}) | "
            f"{s['split_in_proportional_epoch']} | {s['proportional_split']} | {s['final_split']} | "
            f"{', '.join(_f(x) for x in s['equal_split_disturbed_samples_per_s']) or '-'} | "
            f"{'PASS' if s['pass'] else 'FAIL'} |")
    per_epoch = ["", f"per epoch (batch sizes / samples/s; the disturbance from epoch {from_epoch}):"]
    for la in launches:
        cells = [f"{e['epoch']}:{e['batch_sizes']}/{_f(e.get('samples_per_s'))}" for e in la.epochs]
        per_epoch.append(f"  {la.form} {la.index}: " + "  ".join(cells))
        for d in la.decisions:
            if d.get("adopted") or d.get("event") == "revert":
                per_epoch.append(f"      epoch {d['epoch']} {d.get('event')}: {str(d.get('reason', '')).splitlines()[0]}")
    return "\n".join(rows + per_epoch)


def device_names(profile: Path) -> list[str]:
    d = json.loads(profile.read_text(encoding="utf-8"))
    return [str(r.get("device_name") or r.get("device")) for r in sorted(d["ranks"], key=lambda r: r["rank"])]


# -- main ---------------------------------------------------------------------------------------------------------------
def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the cpu case; cuda: a GPU case (--case, default cuda-cpu)")
    p.add_argument("--case", choices=tuple(CASES), default=None, help="the setting (default from --device)")
    p.add_argument("--forms", default=",".join(FORMS), help="comma-separated, of own,train (default both)")
    p.add_argument("--launches", type=int, default=None, help="launches of each form (default 5 on CPU, 1 on GPU)")
    p.add_argument("--epochs", type=int, default=9, help="epochs per launch (default 9)")
    p.add_argument("--num-samples", type=int, default=None, help="samples per epoch (default the case's)")
    p.add_argument("--launch-timeout-s", type=float, default=None, help="kill a launch after this (default the case's)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no launch the longest one so far would carry past this (default: GPU cases 225)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the records go (default docs/results)")
    p.add_argument("--no-records", action="store_true", help="print the table only")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder of logs (its path is printed)")
    p.add_argument("--no-pin", action="store_true", help="leave the ranks on every core (default: the case's)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    name = args.case or ("cpu" if args.device == "cpu" else "cuda-cpu")
    case = CASES[name]
    if (args.device == "cuda") != any(d.startswith("cuda") for d in case.devices):
        print(f"--case {name} runs on {','.join(case.devices)}, not --device {args.device}", file=sys.stderr)
        return 2
    case = replace(case, num_samples=args.num_samples or case.num_samples,
                   launches=args.launches or case.launches,
                   launch_timeout_s=args.launch_timeout_s or case.launch_timeout_s,
                   budget_s=args.budget_s if args.budget_s is not None else case.budget_s,
                   pin_cores=case.pin_cores and not args.no_pin)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if not forms or any(f not in FORMS for f in forms):
        print(f"--forms: choose from {', '.join(FORMS)}", file=sys.stderr)
        return 2
    if args.epochs <= case.from_epoch + 1:
        print(f"--epochs must exceed {case.from_epoch + 1}: the disturbance starts at epoch {case.from_epoch}",
              file=sys.stderr)
        return 2
    import torch  # only once the arguments are good: --help stays fast

    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="replan_midrun_"))
    print(f"case {name}: {case.heterogeneity}; {case.launches} launch(es) x {forms}, {args.epochs} epochs, "
          f"global batch {case.global_batch}, {case.num_samples} samples an epoch; logs in {tmp}", flush=True)
    profile, plan, plan_cmd = make_plan(case, tmp, case.launch_timeout_s)
    start_split = json.loads(plan.read_text())
    min_batch = int(start_split.get("min_batch") or 1)
    print(f"start plan {[r['batch_size'] for r in start_split['ranks']]} from {profile}", flush=True)
    cores = rank_cores(case)
    meta = {"world_size": len(case.devices), "global_batch": case.global_batch, "model": case.model,
            "devices": device_names(profile), "rank_devices": list(case.devices), "amp": case.amp,
            "data": "inputs held in memory (no loader workers)" if case.data == "synthetic"
            else "FakeData through the PIL pipeline in DataLoader workers",
            "num_samples": case.num_samples, "epochs": args.epochs, "first_disturbed_epoch": case.from_epoch,
            "torch": torch.__version__, "python": platform.python_version(), "host_cores": os.cpu_count(),
            "rank_cores": [sorted(c) if c else None for c in cores], "plan_command": plan_cmd,
            "hog_cores": hog_cores(case, cores) if case.cotenant == "cpu-hog" else None,
            "start_batch_sizes": [r["batch_size"] for r in start_split["ranks"]]}
    launches: list[Launch] = []
    longest = 0.0
    for i in range(1, case.launches + 1):
        for form in forms:  # interleaved, so a drift of the box spreads over both forms alike
            if case.budget_s is not None and time.monotonic() - t_start + longest > case.budget_s:
                print(f"budget: {form} launch {i} not started ({case.budget_s:g} s)", flush=True)
                continue
            d = tmp / f"{form}_{i}"
            d.mkdir()
            log = d / "run.jsonl"
            build = own_command if form == "own" else train_command
            cmd = build(case, args.epochs, plan, profile, log, args.seed)
            envs = rank_envs(case, cores)
            noise = Disturbance(case, cores, d) if case.cotenant else None
            state: dict[str, int] = {}

            def fire(noise: Disturbance | None = noise, state: dict[str, int] = state) -> None:
                if noise is not None:
                    noise.fire()
                    state["at"] = case.from_epoch

            try:
                rc, timed_out, wall = run_ranks([cmd] * len(case.devices), envs, cores, d, case.launch_timeout_s,
                                                watch=log if noise else None,
                                                at_epoch=case.from_epoch if noise else None, on_epoch=fire)
            finally:
                if noise is not None:
                    noise.stop()
            longest = max(longest, wall)
            epochs, decisions, start_step = read_log(log)
            tail = "" if rc == 0 else (d / "rank0.out").read_text(errors="replace")[-2000:]
            la = Launch(form=form, index=i, command=shlex.join(cmd), rc=rc, timed_out=timed_out, wall_s=wall,
                        epochs=epochs, decisions=decisions, disturbance_at_epoch=state.get("at"), tail=tail)
            la.scores = score(la, case.from_epoch, case.global_batch, min_batch, start_step)
            launches.append(la)
            print(f"{form} launch {i}: rc {rc}{' (timed out)' if timed_out else ''}, {wall:.0f} s, "
                  f"{len(epochs)} epochs logged", flush=True)
            if rc != 0:
                print(tail, flush=True)
    for form in forms:
        score_form([la for la in launches if la.form == form], case)
    print()
    print(table(launches, case.from_epoch))
    if not args.no_records:
        for la in launches:
            print(f"wrote {write_record(la, case, meta, args.results)}")
    if args.keep:
        print(f"logs kept in {tmp}")
    else:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return 0 if launches and all(la.scores["pass"] for la in launches) else 1


if __name__ == "__main__":
    raise SystemExit(main())
