"""Where a DDP step's time goes: per rank and step, when each gradient bucket is ready, when its all-reduce runs,
and how much of it is exposed after the last backward kernel; variants (split, weighting, compression, DDP
settings) interleaved in rounds in one launch.

    torchrun --standalone --nproc-per-node 4 benchmarks/comm_breakdown.py --global-batch 256 \\
        --variants equal,plan,plan+bf16 [--plan plan.json] [--cotenant 2:1,3:2] --json out.jsonl
    torchrun --standalone --nproc-per-node 2 benchmarks/comm_breakdown.py --device cpu --model mlp   (gloo, seconds)
    torchrun --standalone --nproc-per-node 2 benchmarks/comm_breakdown.py --overhead   (the runtime's per-step cost)

Variants (``--variants``, comma-separated), each a fresh DDP model of the same initial weights:
  equal            the global batch split evenly, torch's averaging hook (``allreduce_hook``; with bf16/fp16 torch's
                   ``bf16_compress_hook``/``fp16_compress_hook``): what a DistributedSampler script runs
  plan             the plan's split (``--plan``, else ``--split``: measured throughput-proportional, or B0,B1,..),
                   runtime.register_weighted_hook (n_i / n per rank, SUM)
  NAME+bf16, NAME+fp16   the same with the gradient all-reduced in that dtype (runtime/compress.py for plan);
                   ``--compress`` appends it to every variant that names none
  NAME:cap25, :cap100, :gabv, :static   DDP settings of that variant (bucket_cap_mb, gradient_as_bucket_view,
                   static_graph) over the launch's (``--bucket-cap-mb``, ``--grad-as-bucket-view``, ``--static-graph``)
Every variant runs through a Python comm hook (the timing needs one); a hook costs about the same for all
(``--overhead`` measures it against DDP's C++ all-reduce).

Per step and rank, times on the device (CUDA events; on CPU the host clock), in ms:
  forward      step start -> backward start
  compute      step start -> the last bucket's ready time (its gradients are the backward's last kernels)
  comm busy    sum over buckets of end - start; a bucket's start is max(its ready time, the previous bucket's end):
               DDP launches buckets in order and NCCL runs them in order on one stream, so a bucket starts when it
               is ready and the one before it is done
  exposed      last bucket's all-reduce end - compute end: the communication nobody overlapped
  wait         compute end -> backward() returns (exposed, plus DDP's copy-back and the host's wait)
  optimizer    backward() return -> optimizer step end
  step         step start -> optimizer step end
  buckets      per bucket (DDP order): MB on the wire, ready / start / end after backward start, end - start
A bucket's end is an event recorded in the all-reduce future's then-callback, whose stream waits for the
collective; its ready time is an event recorded on the compute stream when DDP hands the bucket to the hook.
The record gives the median over every timed step of every round, per rank, and samples/s per round (the global
batch times steps over the round's wall time, every rank synchronized first).

DDP settings (``--choose all`` or a list such as ``cap100,static``): the plan and the equal split under the launch's
settings and under each candidate; a candidate is kept only when its median plan step beats the default's by more
than both rounds' spreads and it costs the equal split no more than that margin (planner.comm_model's
choose_launch_env rule, as for the launch environment), so one lucky round picks nothing. ``--plan-out`` writes the
``--plan`` with the winner in ``meta["ddp"]``, which ``planner train --plan`` applies to its DDP.

Output: one JSON object per launch (compact, one line) appended to ``--json`` (default $OUT/comm_breakdown.jsonl
when $OUT is set), and a summary on stdout. NCCL environment variables (NCCL_*) are recorded as set.

Co-tenants: ``--cotenant 2:1,3:2`` starts benchmarks/cotenant.py processes (1 on cuda:2, 2 on cuda:3, at
``--cotenant-duty``) from local rank 0 before the models are built and stops them at the end; or run them beside
the launch yourself (``python benchmarks/cotenant.py --device cuda:2 --duty 0.5 &``) and pass ``--label``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

if not __package__:  # run as a script: the repository's packages; imported as benchmarks.comm_breakdown, they are
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # already on the path

from profiler.workloads.specs import build_workload
from runtime.compress import check_compress, stock_compress_hook
from runtime.sampler import HeteroBatchSampler
from runtime.weighting import register_weighted_hook

CHOICES = ["cap100", "gabv", "static", "cap100:gabv:static"]
SETTINGS = {"cap25": ("bucket_cap_mb", 25.0), "cap100": ("bucket_cap_mb", 100.0),
            "gabv": ("gradient_as_bucket_view", True), "static": ("static_graph", True)}


# -- a learnable CIFAR-sized dataset: the convergence part of gpu_suite.sh ------------------------------------------
class LearnableImages(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """3x32x32 float images whose class a network can learn, each made from its index alone (no files, the same on
    every rank, worker and launch), for ``planner train --dataset benchmarks.comm_breakdown:learnable_cifar``.

    Class c has a fixed template: random 4x4 values per channel, upsampled bilinearly to 32x32 and scaled to unit
    standard deviation (a smooth pattern, as photographs are). Sample i draws from a generator seeded by i: its
    class, a circular shift of up to ``max_shift`` pixels each way, white noise of standard deviation 1 added to
    ``signal`` times the shifted template, and, with probability ``label_noise``, a label drawn afresh. The noise
    hides the pattern from any one pixel, so a network learns it over epochs rather than steps, and the relabelled
    samples keep the best achievable loss well above zero (about 0.5 nats for 10 classes at label_noise 0.1), so
    a relative difference between two loss curves stays meaningful to the last epoch.
    """

    def __init__(self, num_samples: int, num_classes: int = 10, *, signal: float = 0.08, max_shift: int = 8,
                 label_noise: float = 0.1, seed: int = 0, side: int = 32) -> None:
        if num_samples < 1 or num_classes < 2:
            raise ValueError(f"need num_samples >= 1 and num_classes >= 2, got {num_samples}, {num_classes}")
        self.num_samples, self.num_classes, self.signal = num_samples, num_classes, signal
        self.max_shift, self.label_noise, self.seed = max_shift, label_noise, seed
        g = torch.Generator().manual_seed(seed)
        low = torch.randn(num_classes, 3, 4, 4, generator=g)
        t = torch.nn.functional.interpolate(low, size=(side, side), mode="bilinear", align_corners=False)
        self.templates = (t - t.mean(dim=(1, 2, 3), keepdim=True)) / t.std(dim=(1, 2, 3), keepdim=True)
        self.classes = [str(c) for c in range(num_classes)]
        """Class names: their count is the workload's number of classes (profiler.workloads.specs)."""

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        g = torch.Generator().manual_seed((self.seed << 32) + index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        shift = torch.randint(-self.max_shift, self.max_shift + 1, (2,), generator=g).tolist()
        x = torch.randn(self.templates.shape[1:], generator=g)
        x.add_(torch.roll(self.templates[label], shifts=shift, dims=(1, 2)), alpha=self.signal)
        if float(torch.rand((), generator=g)) < self.label_noise:
            label = int(torch.randint(self.num_classes, (1,), generator=g))
        return x, label


LEARNABLE_SAMPLES = 40960
"""learnable_cifar's epoch: 80 steps of a global batch of 512."""


def learnable_cifar(num_classes: int = 10, num_samples: int = LEARNABLE_SAMPLES) -> LearnableImages:
    """``--dataset benchmarks.comm_breakdown:learnable_cifar``: 40960 samples of ``LearnableImages``. A dataset
    factory is called without arguments (`planner train --num-samples` sizes only the built-in fake data), so the
    size is this function's default; ``learnable_cifar_tiny`` is the CPU-sized one."""
    return LearnableImages(num_samples, num_classes)


def learnable_cifar_tiny(num_classes: int = 10, num_samples: int = 1024) -> LearnableImages:
    """``--dataset benchmarks.comm_breakdown:learnable_cifar_tiny``: 1024 samples, for a dry run on CPU."""
    return LearnableImages(num_samples, num_classes)


# -- clocks: CUDA events on the device, the host clock on CPU ------------------------------------------------------
class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A point in time on the current stream (CUDA) or now (CPU)."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a: Any, b: Any) -> float:
        """Milliseconds from a to b (after the device has synchronized)."""
        return float(a.elapsed_time(b)) if self.cuda else (b - a) * 1e3


# -- the timing hook: wraps the variant's own hook -------------------------------------------------------------------
class Recorder:
    """Per step, one entry per bucket: [index, bytes on the wire, ready mark, end mark]."""

    def __init__(self, clock: Clock, inner: Callable[..., Any], inner_state: Any, wire_bytes: int | None) -> None:
        self.clock, self.inner, self.inner_state, self.wire_bytes = clock, inner, inner_state, wire_bytes
        self.step: list[list[Any]] = []

    def take(self) -> list[list[Any]]:
        step, self.step = self.step, []
        return step


def _timed_hook(rec, bucket):  # no annotations: DDP compares them by identity with its own types
    buf = bucket.buffer()
    nbytes = buf.numel() * (rec.wire_bytes or buf.element_size())
    entry = [bucket.index(), nbytes, rec.clock.mark(), None]
    rec.step.append(entry)
    fut = rec.inner(rec.inner_state, bucket)

    def done(f):
        entry[3] = rec.clock.mark()  # on a stream that waits for the collective (CUDA futures)
        return f.value()

    return fut.then(done)


class _Capture:
    """Stands in for the DDP model in register_weighted_hook (its checks run, its hook is kept, not registered),
    so the timing hook can wrap the weighted hook."""

    def __init__(self, ddp: DDP) -> None:
        self.ddp, self.state, self.hook = ddp, None, None

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        self.state, self.hook = state, hook

    def modules(self) -> Iterator[torch.nn.Module]:
        return self.ddp.modules()


# -- variants ---------------------------------------------------------------------------------------------------------
@dataclass
class Variant:
    name: str
    split: str  # 'equal' or 'plan'
    compress: str
    ddp_kw: dict[str, Any]
    opts: str = ""
    """The variant's own DDP settings, ':'-joined as named (cap100:gabv)."""
    batch_sizes: list[int] = field(default_factory=list)
    ddp: Any = None
    opt: Any = None
    sampler: Any = None
    rec: Recorder | None = None
    rounds_samples_per_s: list[float] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)


def parse_variants(text: str, compress: str, base_kw: dict[str, Any]) -> list[Variant]:
    out = []
    for spec in [s.strip() for s in text.split(",") if s.strip()]:
        head, *opts = spec.split(":")
        split, _, comp = head.partition("+")
        if split not in ("equal", "plan"):
            raise SystemExit(f"variant {spec!r}: the split must be 'equal' or 'plan'")
        comp = check_compress(comp or compress)
        kw = dict(base_kw)
        for o in opts:
            if o not in SETTINGS:
                raise SystemExit(f"variant {spec!r}: unknown setting {o!r} (one of {', '.join(SETTINGS)})")
            key, value = SETTINGS[o]
            kw[key] = value
        name = split + ("" if comp == "none" else f"+{comp}") + "".join(":" + o for o in opts)
        out.append(Variant(name=name, split=split, compress=comp, ddp_kw=kw, opts=":".join(opts)))
    if len({v.name for v in out}) != len(out):
        raise SystemExit(f"variants repeat a name: {[v.name for v in out]}")
    return out


def largest_remainder(weights: list[float], total: int, low: int) -> list[int]:
    """Integers >= low summing to total, proportional to weights (largest remainder)."""
    free = total - low * len(weights)
    if free < 0:
        raise SystemExit(f"a global batch of {total} cannot give {len(weights)} ranks {low} samples each")
    raw = [free * w / sum(weights) for w in weights]
    sizes = [int(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: raw[i] - sizes[i], reverse=True)[: free - sum(sizes)]:
        sizes[i] += 1
    return [s + low for s in sizes]


def equal_split(total: int, world: int) -> list[int]:
    q, r = divmod(total, world)
    return [q + 1 if i < r else q for i in range(world)]


def measured_split(wl: Any, x: torch.Tensor, y: torch.Tensor, device: torch.device, clock: Clock, world: int,
                   total: int, amp: bool, low: int) -> tuple[list[int], list[float]]:
    """Each rank times forward+backward alone at the equal batch; the split is proportional to samples/s."""
    b = equal_split(total, world)[dist.get_rank()]
    torch.manual_seed(0)
    model = to_device(wl.model_fn(), device)
    times = []
    for i in range(8):
        a = clock.mark()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = wl.loss_fn(model(x[:b]), y[:b])
        loss.backward()
        e = clock.mark()
        sync(device)
        if i >= 3:
            times.append(clock.ms(a, e))
    del model
    rate = b / statistics.median(times)
    rates: list[float] = [0.0] * world
    dist.all_gather_object(rates, rate)
    return largest_remainder(rates, total, low), rates


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    if device.type == "cuda" and model_is_image(model):
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return model


def model_is_image(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def build(v: Variant, wl: Any, device: torch.device, clock: Clock, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = to_device(wl.model_fn(), device)
    v.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **v.ddp_kw)
    v.opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    v.sampler = HeteroBatchSampler(10**6, v.batch_sizes, rank, prefetch=False)
    wire = {"none": None, "bf16": 2, "fp16": 2}[v.compress]
    if v.split == "plan":
        cap = _Capture(v.ddp)
        register_weighted_hook(cap, v.sampler, compress=v.compress)  # type: ignore[arg-type]
        v.rec = Recorder(clock, cap.hook, cap.state, wire)  # type: ignore[arg-type]
    else:
        stock = stock_compress_hook(v.compress)
        if stock is None:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            stock = default_hooks.allreduce_hook
        v.rec = Recorder(clock, stock, None, wire)
    v.ddp.register_comm_hook(v.rec, _timed_hook)


def run_round(v: Variant, x: torch.Tensor, y: torch.Tensor, wl: Any, device: torch.device, clock: Clock,
              steps: int, amp: bool, rank: int, keep: bool) -> float:
    """``steps`` optimizer steps of variant v; returns the round's wall seconds (after a barrier)."""
    assert v.rec is not None
    b = v.batch_sizes[rank]
    it = iter(v.sampler)  # a new pass: the weighted hook's step count restarts
    marks = []
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
        s0 = clock.mark()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = wl.loss_fn(v.ddp(x[:b]), y[:b])
        s1 = clock.mark()
        loss.backward()
        s2 = clock.mark()
        v.opt.step()
        v.opt.zero_grad(set_to_none=True)
        s3 = clock.mark()
        marks.append((s0, s1, s2, s3, v.rec.take()))
    sync(device)
    wall = time.perf_counter() - t0
    if keep:
        v.steps.extend(step_times(clock, m) for m in marks)
    return wall


def step_times(clock: Clock, m: tuple[Any, ...]) -> dict[str, Any]:
    s0, s1, s2, s3, buckets = m
    ms = clock.ms
    rows, prev_end = [], None
    for index, nbytes, ready, end in buckets:
        r, e = ms(s1, ready), ms(s1, end)
        start = r if prev_end is None else max(r, prev_end)
        rows.append({"index": index, "mb": nbytes / 2**20, "ready_ms": r, "start_ms": start, "end_ms": e,
                     "allreduce_ms": e - start})
        prev_end = e
    fwd = ms(s0, s1)
    compute_end = rows[-1]["ready_ms"] if rows else ms(s1, s2)  # after backward start
    comm_end = max((r["end_ms"] for r in rows), default=compute_end)
    return {"forward_ms": fwd, "compute_ms": fwd + compute_end, "comm_busy_ms": sum(r["allreduce_ms"] for r in rows),
            "exposed_ms": max(0.0, comm_end - compute_end), "wait_ms": ms(s1, s2) - compute_end,
            "optimizer_ms": ms(s2, s3), "step_ms": ms(s0, s3), "buckets": rows}


def medians(steps: list[dict[str, Any]]) -> dict[str, Any]:
    if not steps:
        return {}
    out: dict[str, Any] = {k: round(statistics.median(s[k] for s in steps), 3) for k in steps[0] if k != "buckets"}
    counts = {len(s["buckets"]) for s in steps}
    n = min(counts)
    out["buckets"] = [{k: steps[0]["buckets"][i][k] if k == "index" else
                       round(statistics.median(s["buckets"][i][k] for s in steps), 3)
                       for k in steps[0]["buckets"][i]} for i in range(n)]
    if len(counts) > 1:
        out["bucket_counts"] = sorted(counts)  # DDP rebuilt its buckets during the timed steps
    return out


# -- co-tenants -------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def cotenants(spec: str | None, duty: float, local_rank: int) -> Iterator[dict[str, int]]:
    """Start benchmarks/cotenant.py processes ('GPU:N,..'; 'cpu:N' on CPU) on local rank 0; stop them on exit."""
    wanted: dict[str, int] = {}
    for part in [p for p in (spec or "").split(",") if p]:
        dev, _, n = part.partition(":")
        wanted[dev] = int(n or 1)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if local_rank == 0:
            script = Path(__file__).resolve().parent / "cotenant.py"
            for dev, n in wanted.items():
                device = dev if dev == "cpu" else f"cuda:{dev}"
                for _ in range(n):
                    procs.append(subprocess.Popen([sys.executable, str(script), "--device", device, "--duty",
                                                   str(duty)], stderr=subprocess.PIPE, start_new_session=True))
            for p in procs:  # each prints one line once it holds its memory and starts its loop
                assert p.stderr is not None
                p.stderr.readline()
            if procs:
                time.sleep(3.0)  # their loops settle
        yield wanted
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- main -------------------------------------------------------------------------------------------------------------
def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (NCCL) or cpu (gloo)")
    p.add_argument("--model", default=None, help="workload model (default resnet50 on CUDA, mlp on CPU)")
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--amp", action="store_true", help="bf16 autocast (default fp32)")
    p.add_argument("--global-batch", type=int, default=None, help="samples per step, all ranks (default 256; 32 CPU)")
    p.add_argument("--variants", default=None, help="comma-separated (default: equal,plan)")
    p.add_argument("--plan", default=None, help="plan JSON: the 'plan' variants' batch sizes")
    p.add_argument("--split", default="measured",
                   help="without --plan: 'measured' (each rank's samples/s alone, timed first) or B0,B1,..")
    p.add_argument("--compress", default="none", choices=("none", "bf16", "fp16"),
                   help="wire dtype for every variant that names none")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--grad-as-bucket-view", action="store_true")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant and round (default 20)")
    p.add_argument("--warmup", type=int, default=8, help="untimed steps per variant first")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every variant (default 3)")
    p.add_argument("--cotenant", default=None, metavar="GPU:N,..",
                   help="start N benchmarks/cotenant.py processes on each GPU (e.g. 2:1,3:2; cpu:1 on CPU)")
    p.add_argument("--cotenant-duty", type=float, default=0.5)
    p.add_argument("--label", default=None, help="free text recorded with the launch (e.g. the co-tenants run beside)")
    p.add_argument("--json", default=None, help="append the launch's record here (default $OUT/comm_breakdown.jsonl)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="process-group timeout")
    p.add_argument("--choose", default=None, metavar="C,..",
                   help="time candidate DDP settings (each a ':'-joined set, e.g. cap100,gabv,static,cap100:gabv:static;"
                        " 'all' for those four) at the plan's and the equal split against the launch's settings, and "
                        "pick a winner by planner.comm_model.choose_launch_env's rule (sets the variants)")
    p.add_argument("--plan-out", default=None,
                   help="with --choose and --plan: write the plan with the winner in meta['ddp'] (what `planner "
                        "train` applies); without a winner, the plan unchanged")
    p.add_argument("--overhead", action="store_true",
                   help="instead: the runtime pieces' per-step cost against plain DDP (see overhead())")
    p.add_argument("--batch", type=int, default=512, help="--overhead: the per-rank batch (default 512)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.overhead:
        return overhead(args)
    args.steps, args.rounds = args.steps or 20, args.rounds or 3
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("comm_breakdown: no CUDA device here; run with --device cpu (gloo) for a dry run", file=sys.stderr)
        return 2
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with cotenants(args.cotenant, args.cotenant_duty, local_rank) as started:
            dist.barrier()
            record = breakdown(args, device, rank, world)
            if started:
                record["cotenant"] = {"processes": started, "duty": args.cotenant_duty}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        report(record)
        if args.plan_out and args.plan and "ddp_choice" in record:
            write_plan(args.plan, args.plan_out, record)
        path = args.json or (os.path.join(os.environ["OUT"], "comm_breakdown.jsonl") if os.environ.get("OUT") else None)
        if path:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, separators=(",", ":")) + "\n")
    return 0


def breakdown(args: argparse.Namespace, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    cuda = device.type == "cuda"
    model_name = args.model or ("resnet50" if cuda else "mlp")
    total = args.global_batch or (256 if cuda else 32)
    wl = build_workload(model_name, "fake", image_size=args.image_size, num_samples=10**6)
    low = wl.min_batch
    clock = Clock(device)
    base_kw = {"bucket_cap_mb": args.bucket_cap_mb, "static_graph": args.static_graph,
               "gradient_as_bucket_view": args.grad_as_bucket_view}
    candidates: list[str] = []
    if args.choose:
        candidates = CHOICES if args.choose == "all" else [c for c in args.choose.split(",") if c]
        args.variants = ",".join(["plan", "equal"] + [f"{s}:{c}" for c in candidates for s in ("plan", "equal")])
    variants = parse_variants(args.variants or "equal,plan", args.compress, base_kw)

    plan_sizes: list[int] | None = None
    split_source, rates = None, None
    if any(v.split == "plan" for v in variants):
        if args.plan:
            from planner.plan import Plan

            plan = Plan.load(args.plan)
            if plan.world_size != world:
                raise SystemExit(f"--plan is for {plan.world_size} ranks, {world} launched")
            if any(r.accumulation_steps > 1 for r in plan.ranks):
                raise SystemExit("--plan has micro-batches (accumulation_steps > 1); time a plan without them")
            plan_sizes, split_source, total = list(plan.batch_sizes), f"plan {args.plan}", plan.global_batch
        elif args.split != "measured":
            plan_sizes = [int(b) for b in args.split.split(",")]
            if len(plan_sizes) != world:
                raise SystemExit(f"--split has {len(plan_sizes)} sizes for {world} ranks")
            split_source, total = "given", sum(plan_sizes)
    x = torch.randn(total, *wl.sample_shape, device=device)
    if cuda and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, wl.num_classes or 10, (total,), device=device)
    if any(v.split == "plan" for v in variants) and plan_sizes is None:
        plan_sizes, rates = measured_split(wl, x, y, device, clock, world, total, args.amp, low)
        split_source = "measured: samples/s of each rank alone at the equal batch, proportional"
    for v in variants:
        v.batch_sizes = list(plan_sizes) if v.split == "plan" and plan_sizes else equal_split(total, world)
        build(v, wl, device, clock, rank, world)
    for v in variants:
        run_round(v, x, y, wl, device, clock, args.warmup, args.amp, rank, keep=False)
    for r in range(args.rounds):  # alternate the order so drift hits every variant alike
        order = variants if r % 2 == 0 else list(reversed(variants))
        for v in order:
            wall = run_round(v, x, y, wl, device, clock, args.steps, args.amp, rank, keep=True)
            walls: list[float] = [0.0] * world
            dist.all_gather_object(walls, wall)
            v.rounds_samples_per_s.append(round(sum(v.batch_sizes) * args.steps / max(walls), 2))
    per_rank = {v.name: medians(v.steps) for v in variants}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                                      "medians": per_rank})
    record: dict[str, Any] = {
        "record": "comm_breakdown", "version": 1, "time": time.time(), "torch": torch.__version__,
        "backend": dist.get_backend(), "world_size": world, "devices": [g["device"] for g in gathered],
        "model": model_name, "amp": args.amp, "image_size": args.image_size, "global_batch": total,
        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "split": split_source,
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        "variants": {},
    }
    if rates is not None:
        record["measured_samples_per_s"] = [round(r * 1e3, 1) for r in rates]
    if args.label:
        record["label"] = args.label
    if candidates:
        record["ddp_choice"] = choose(variants, candidates, total)
    for v in variants:
        record["variants"][v.name] = {
            "split": v.split, "compress": v.compress, "ddp": v.ddp_kw, "batch_sizes": v.batch_sizes,
            "samples_per_s": statistics.median(v.rounds_samples_per_s), "rounds_samples_per_s": v.rounds_samples_per_s,
            "ranks": [g["medians"][v.name] for g in gathered],
        }
    return record


def choose(variants: list[Variant], candidates: list[str], total: int) -> dict[str, Any]:
    """The DDP settings to record: a candidate wins when its median plan step beats the default's by more than
    both rounds' spreads and it costs the equal split no more than that margin (choose_launch_env's rule)."""
    from planner.comm_model import choose_launch_env

    def step_s(split: str, opts: str) -> list[float]:
        v = next(x for x in variants if x.split == split and x.opts == opts)
        return [total / s for s in v.rounds_samples_per_s if s > 0]

    default = (step_s("plan", ""), step_s("equal", ""))
    cands = {c: ({"settings": c}, step_s("plan", c), step_s("equal", c)) for c in candidates}
    # one round has no spread to beat: any candidate a little faster by chance would win
    won = choose_launch_env(default, cands) if min(len(default[0]), len(default[1])) >= 2 else None
    settings = dict(SETTINGS[o] for o in won[0].split(":")) if won else {}
    return {"candidates": candidates, "winner": won[0] if won else None, "settings": settings,
            "plan_step_ms": {c: round(statistics.median(cands[c][1]) * 1e3, 3) for c in candidates}
            | {"default": round(statistics.median(default[0]) * 1e3, 3)},
            "rule": "median plan step below the default's by more than both rounds' spreads, the equal split's "
                    "no more than that margin above (planner.comm_model.choose_launch_env)"}


def report(record: dict[str, Any]) -> None:
    print(f"{record['model']} B={record['global_batch']} on {record['world_size']} x {record['devices'][0]} "
          f"({record['backend']}, torch {record['torch']}); split: {record['split']}")
    for name, v in record["variants"].items():
        rounds = v["rounds_samples_per_s"]
        print(f"{name:22s} {v['samples_per_s']:10.1f} samples/s (rounds {min(rounds):.1f}-{max(rounds):.1f}) "
              f"batches {v['batch_sizes']}")
        for r, m in enumerate(v["ranks"]):
            if m:
                print(f"   rank {r}: step {m['step_ms']:7.2f} ms = compute {m['compute_ms']:7.2f} + wait "
                      f"{m['wait_ms']:6.2f} (exposed comm {m['exposed_ms']:6.2f}, busy {m['comm_busy_ms']:6.2f} in "
                      f"{len(m['buckets'])} buckets) + optimizer {m['optimizer_ms']:6.2f}")


def write_plan(src: str, dst: str, record: dict[str, Any]) -> None:
    """The plan at ``src`` with the chosen DDP settings in meta['ddp'] and the evidence in meta['ddp_choice']."""
    import dataclasses

    from planner.plan import Plan

    plan = Plan.load(src)
    choice = record["ddp_choice"]
    meta = {k: v for k, v in plan.meta.items() if k not in ("ddp", "ddp_choice")}
    if choice["winner"]:
        meta["ddp"] = choice["settings"]
    meta["ddp_choice"] = {"winner": choice["winner"], "plan_step_ms": choice["plan_step_ms"],
                          "devices": record["devices"], "nccl_env": record["nccl_env"]}
    dataclasses.replace(plan, meta=meta).save(dst)
    print(f"wrote {dst}: DDP settings {choice['settings'] or 'unchanged (no candidate beat the default)'}")


# -- the runtime's per-step cost against plain DDP ------------------------------------------------------------------
OVERHEAD_VARIANTS = ("ddp", "pyhook", "weighted", "weighted+timer", "loss_scale", "loss_scale+timer",
                     "loss_scale+gradtimer")


def overhead(args: argparse.Namespace) -> int:
    """``--overhead``: the cost of each runtime piece on a fast, launch-bound model, against plain DDP.

    Variants (each a fresh DDP model; alternating rounds; median over rounds), equal batches on every rank,
    synthetic data on the device, bf16 autocast on CUDA, SGD:
      ddp          plain DDP, default (C++) all-reduce -- what a DistributedSampler script runs
      pyhook       DDP + torch's own Python allreduce_hook (the cost any Python comm hook pays)
      weighted     DDP + runtime.register_weighted_hook
      weighted+timer   the above + StepTimer (events at forward start and in the hook)
      loss_scale   plain DDP, loss multiplied by runtime.weighting.loss_scale(sampler, step) (exact, no hook)
      loss_scale+timer the above + StepTimer, compute end recorded after backward() returns
      loss_scale+gradtimer  the above, compute end recorded when the first parameter's gradient is accumulated
                   (runtime.timing.close_compute_on_last_gradient) -- what `planner train` runs by default
    Defaults: resnet18 at 32 px, --batch 512 per rank, 60 steps, 5 rounds (--model, --image-size, --steps,
    --rounds). Prints ms/step per variant and the ratio to plain DDP; --json
    writes them.
    """
    from runtime.timing import StepTimer, close_compute_on_last_gradient
    from runtime.weighting import loss_scale

    model_name, image_size = args.model or "resnet18", args.image_size or 32
    batch, steps, rounds = args.batch, args.steps or 60, args.rounds or 5
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = args.device == "cuda" and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:  # CPU/gloo only for a dry run of this mode
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    torch.backends.cudnn.benchmark = True
    wl = build_workload(model_name, "fake", image_size=image_size, num_samples=10**6)
    x0 = wl.dataset[0][0]
    x = torch.randn(batch, *x0.shape, device=device)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    sampler = HeteroBatchSampler(10**6, [batch] * world, rank, prefetch=False)

    setups = {}
    for v in OVERHEAD_VARIANTS:
        torch.manual_seed(0)
        model = wl.model_fn().to(device)
        if model_is_image(model):
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        ddp = DDP(model, device_ids=[device.index] if cuda else None)
        timer = StepTimer(device) if v.endswith("timer") else None
        if v.endswith("+gradtimer"):
            assert timer is not None
            close_compute_on_last_gradient(model, timer)
        if v == "pyhook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif v.startswith("weighted"):
            register_weighted_hook(ddp, sampler, on_last_bucket=timer.compute_end if timer else None)
        setups[v] = (ddp, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9), timer)

    def run(v: str, n: int) -> float:
        ddp, opt, timer = setups[v]
        it = iter(sampler)  # a new pass: the weighted hook's step count restarts
        if timer is not None:
            timer.reset()
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(n):
            next(it)
            if timer is not None:
                timer.compute_start()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = wl.loss_fn(ddp(x), y)
            if v.startswith("loss_scale"):
                loss = loss * loss_scale(sampler, step)
            loss.backward()
            if timer is not None:
                timer.compute_end()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if timer is not None:
                timer.step_end()
        sync(device)
        return (time.perf_counter() - t0) / n

    for v in OVERHEAD_VARIANTS:
        run(v, 15)  # warm-up: cudnn autotune, allocator, NCCL
    per: dict[str, list[float]] = {v: [] for v in OVERHEAD_VARIANTS}
    for r in range(rounds):
        order = OVERHEAD_VARIANTS if r % 2 == 0 else tuple(reversed(OVERHEAD_VARIANTS))
        for v in order:
            per[v].append(run(v, steps))
    med = {v: statistics.median(ts) for v, ts in per.items()}
    if rank == 0:
        print(f"{model_name} {image_size}px, batch {batch}/rank x {world}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}")
        # Paired ratios: each round runs every variant back to back, so round-to-round drift (which is large on a
        # launch-bound model: host jitter) cancels in the per-round ratio to plain DDP.
        for v in OVERHEAD_VARIANTS:
            paired = statistics.median(d / t for d, t in zip(per["ddp"], per[v], strict=True))
            print(f"{v:18s} median {med[v] * 1e3:8.3f} ms/step  mean {statistics.fmean(per[v]) * 1e3:8.3f}  "
                  f"x{paired:.3f} of plain DDP throughput (median of per-round ratios)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": model_name, "image_size": image_size, "batch": batch, "world": world,
                           "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                           "ms_per_step": {v: [t * 1e3 for t in per[v]] for v in OVERHEAD_VARIANTS}}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
