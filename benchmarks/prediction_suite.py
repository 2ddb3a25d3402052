"""How far is a plan's printed step time from the step it then runs, at batch sizes and splits the profile never ran?

Usage (from the repository root):

    python benchmarks/prediction_suite.py --cases cpu --code COMMIT              # every CPU case (~25 min loaded)
    python benchmarks/prediction_suite.py --cases gpu --code COMMIT              # every GPU case, one GPU
    python benchmarks/prediction_suite.py --cases gpu-alone,cuda-cpu --code C    # some cases
    python benchmarks/prediction_suite.py --cases gpu --dry-run --results /tmp/r # the GPU cases' logic on CPU

Each case runs what a user runs -- ``planner profile`` then ``planner plan`` (--from-batches for a held-out
size), or ``planner bench`` (which profiles, plans and runs each split) -- and writes one record per row to
``--results`` (default docs/results/), ``<card>_prediction_<case>_<nn>.json``: the plan's predicted step time
and samples/s, the measured ones, error = measured / predicted - 1, whether every rank's batch is one the profile
never ran (``held_out``), ``source`` (real, or emulated and how), devices, torch and the code commit.  The GPU
part has run only as ``--dry-run``; it builds a fresh runner per call, so run it as two commands (``--cases
gpu-alone``, then ``--cases gpu-accum,cuda-cpu,shared,cotenant``) to stay within a 10-minute call; the CPU part
took ~25 minutes on the loaded 2-core box.

Measured:
  * alone / accumulation cases: the rank alone at the batch (and micro-batches) the plan gives, timed with the
    step the profiler and ``planner bench``'s ideal use (planner.cli.bench._standalone_step_s: 3 warm-up steps,
    then the median of 5 on CPU, 15 on a GPU), 3 rounds; the row's measured step is the median round.  Each round
    also times the profiled size nearest the batch (the control): its measured / profiled step is the host's
    drift since the profile (``drift``), and ``error_drift_corrected`` = measured / (predicted x drift) - 1 is
    what the curve itself got wrong -- on a loaded host the drift is most of ``error``;
  * bench cases: ``planner bench --rounds 3``: each strategy's split (equal, proportional, plan) timed in
    interleaved rounds, its median round; every strategy is one row.

Cases (CPU): cpu-alone (mlp, cifar_cnn; one process), cpu-accum (cifar_cnn, a global batch over
``--max-micro-batch``: CPU has no device memory to cap, so the cap is the plan's option), cpu-slowdown (2 gloo
ranks of mlp, rank 1 emulated 2x and 3x), cpu-loader (2 and 3 gloo ranks of mlp fed by a DataLoader whose every
sample sleeps 3 ms, the last rank capped at 1 worker).  The bench cases train mlp: on the loaded 2-core box a
cifar_cnn launch (2.7 s a step at 36) ran past the bench's 540 s timeout.  GPU (one card): gpu-alone (resnet50 bf16 channels-last, resnet18,
tiny_lm:small), gpu-accum (resnet50 under --emulate-memory), cuda-cpu (a CUDA rank beside a CPU rank), shared
(two ranks on the one GPU), cotenant (resnet50 alone beside benchmarks/cotenant.py at duty 0.5, during profile
and measurement alike).  ``--dry-run`` runs the GPU cases with cpu for every cuda device and mlp-sized models.

The table: ``python benchmarks/summarize_bench.py --write docs/PERFORMANCE.md`` ("prediction" block).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# On a host of a few cores, one intra-op thread unless told otherwise, in this process (the alone measurements) and
# in every `planner` process it starts alike: there, beside other work, two spinning OpenMP threads per process made
# a CPU step 3-30x slower than one thread (mlp at batch 32: 468 ms against 15 ms on a loaded 2-core box).  A larger
# host (a GPU machine's CPU rank) keeps torch's default.
if (os.cpu_count() or 1) <= 4:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

RESULTS = ROOT / "docs" / "results"
PLANNER = [sys.executable, "-m", "planner"]
ROUNDS = 3


# -- running what a user runs ---------------------------------------------------------------------------------
def _run(cmd: Sequence[str], *, timeout: float = 600) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    print("+", shlex.join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return p.stdout


def profile(tmp: Path, name: str, model: str, device: str, sizes: Sequence[int], *, image_size: int | None = None,
            amp: bool = False, extra: Sequence[str] = ()) -> Path:
    out = tmp / f"{name}_profile.json"
    cmd = [*PLANNER, "profile", "--model", model, "--dataset", "fake_text" if model.startswith("tiny_lm") else "fake",
           "--device", device, "--batch-sizes", ",".join(map(str, sizes)), "--no-loader", "--quiet",
           "--out", str(out)]
    if image_size:
        cmd += ["--image-size", str(image_size)]
    if amp:
        cmd.append("--amp")
    _run([*cmd, *extra])
    return out


def plan(profile_path: Path, global_batch: int, *args: str) -> dict[str, Any]:
    out = _run([*PLANNER, "plan", "--profile", str(profile_path), "--global-batch", str(global_batch), "--json",
                *args])
    return dict(json.loads(out))


def profiled_sizes(profile_path: Path) -> list[list[int]]:
    d = json.loads(profile_path.read_text())
    return [sorted({int(p["batch_size"]) for p in r["compute"]}) for r in d["ranks"]]


def measure_alone(model: str, device: str, batch: int, accumulation_steps: int, control: int, *,
                  image_size: int | None, amp: bool) -> tuple[list[float], list[float]]:
    """ROUNDS medians of the rank alone at `batch` in `accumulation_steps` micro-batches (bench's ideal step), and
    in each round, right after it, the median at `control`, a size the profile ran (the host's drift since)."""
    from planner.cli.bench import _standalone_step_s
    from profiler.workloads.specs import build_workload

    workload = build_workload(model, "fake_text" if model.startswith("tiny_lm") else "fake", image_size=image_size)
    opts = SimpleNamespace(amp=amp, steps=5 if dev_is_cpu(device) else 15)
    dev = torch.device(device)
    held, ctrl = [], []
    for _ in range(ROUNDS):
        held.append(_standalone_step_s(workload, dev, batch, 1.0, opts, None, accumulation_steps))  # type: ignore[arg-type]
        ctrl.append(_standalone_step_s(workload, dev, control, 1.0, opts, None))  # type: ignore[arg-type]
    return held, ctrl


def profiled_step(profile_path: Path, batch: int) -> float:
    """Rank 0's profiled step at `batch` (the median of its points there)."""
    d = json.loads(profile_path.read_text())
    return statistics.median(p["step_time_s"] for p in d["ranks"][0]["compute"] if p["batch_size"] == batch)


def nearest(sizes: Sequence[int], b: int) -> int:
    return min(sizes, key=lambda x: (abs(x - b), x))


def drift_fields(profile_path: Path, control: int, ctrl: list[float], predicted: float,
                 measured: float) -> dict[str, Any]:
    """The control size's measured / profiled step (the host's drift between profile and run) and the error with
    that drift taken out: measured / (predicted x drift) - 1, what the model alone got wrong."""
    drift = statistics.median(ctrl) / profiled_step(profile_path, control)
    return {"control_batch": control, "control_rounds_step_s": ctrl, "drift": drift,
            "error_drift_corrected": measured / (predicted * drift) - 1.0}


def dev_is_cpu(device: str) -> bool:
    return not device.startswith("cuda")


# -- rows -----------------------------------------------------------------------------------------------------
class Suite:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.results: Path = args.results
        self.rows: list[dict[str, Any]] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="prediction_suite_"))

    def dev(self, device: str) -> str:
        return "cpu" if self.args.dry_run and device.startswith("cuda") else device

    def model(self, model: str) -> str:
        return "mlp" if self.args.dry_run and model not in ("mlp",) else model

    def note(self) -> str:
        la = os.getloadavg()
        parts = [f"load average {la[0]:.1f} on {os.cpu_count()} cores at the row's end"]
        if self.args.note:
            parts.append(self.args.note)
        if self.args.dry_run:
            parts.append("dry run: cuda devices replaced by cpu, models by mlp")
        return "; ".join(parts)

    def add(self, case: str, card: str, **row: Any) -> None:
        pred, meas = row["predicted_step_s"], row["measured_step_s"]
        gb = row["global_batch"]
        rec = {"record": 1, "kind": "prediction", "case": case,
               "card": card, **row, "predicted_samples_per_s": gb / pred, "measured_samples_per_s": gb / meas,
               "error": meas / pred - 1.0, "torch": torch.__version__, "code": self.args.code,
               "notes": self.note(), "unix": round(time.time(), 1)}
        self.results.mkdir(parents=True, exist_ok=True)
        stem = f"{card}_prediction_{case}"
        n = 1
        while (self.results / f"{stem}_{n:02d}.json").exists():
            n += 1
        path = self.results / f"{stem}_{n:02d}.json"
        path.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
        self.rows.append(rec)
        print(f"{path.name}: {row['model']} {row['batch_sizes']} k={row.get('accumulation_steps')} "
              f"predicted {1000 * pred:.2f} ms measured {1000 * meas:.2f} ms error {rec['error']:+.1%}", flush=True)

    # alone: profile a few sizes, predict sizes between and beyond them
    def alone(self, case: str, card: str, model: str, device: str, sizes: Sequence[int], held: Sequence[int], *,
              image_size: int | None = None, amp: bool = False, source: str = "real") -> None:
        model, device = self.model(model), self.dev(device)
        if self.args.dry_run:
            image_size = None
        p = profile(self.tmp, f"{case}_{model}", model, device, sizes, image_size=image_size, amp=amp)
        ran = profiled_sizes(p)
        for b in held:
            pl = plan(p, b, "--from-batches", str(b))
            control = nearest(ran[0], b)
            rounds, ctrl = measure_alone(model, device, b, 1, control, image_size=image_size, amp=amp)
            pred, meas = pl["predicted"]["step_time_s"], statistics.median(rounds)
            self.add(case, card, model=model if image_size is None else f"{model}@{image_size}px",
                     devices=[device], source=source, amp=amp, global_batch=b, batch_sizes=[b],
                     accumulation_steps=[1], profiled_batch_sizes=ran, held_out=b not in ran[0],
                     predicted_step_s=pred, measured_step_s=meas, rounds_step_s=rounds,
                     **drift_fields(p, control, ctrl, pred, meas),
                     measured="rank alone, 3 warm-up + median of 5 (CPU) or 15 steps, median of 3 rounds; each round "
                     "then the control size alike",
                     command=shlex.join([*PLANNER[2:], "plan", "--global-batch", str(b), "--from-batches", str(b)]))

    # accumulation: a global batch over the micro-batch cap, the plan's k micro-steps
    def accum(self, case: str, card: str, model: str, device: str, sizes: Sequence[int], batches: Sequence[int],
              *, cap_args: Sequence[str], profile_extra: Sequence[str] = (), image_size: int | None = None,
              amp: bool = False, source: str) -> None:
        model, device = self.model(model), self.dev(device)
        if self.args.dry_run:
            image_size, profile_extra, cap_args = None, (), ("--max-micro-batch", "16")
        p = profile(self.tmp, f"{case}_{model}", model, device, sizes, image_size=image_size, amp=amp,
                    extra=profile_extra)
        ran = profiled_sizes(p)
        for gb in batches:
            pl = plan(p, gb, *cap_args)
            r0 = pl["ranks"][0]
            k = int(r0.get("accumulation_steps", 1))
            from planner.plan import micro_batch_sizes

            micro = micro_batch_sizes(int(r0["batch_size"]), k)
            control = nearest(ran[0], micro[0])
            rounds, ctrl = measure_alone(model, device, int(r0["batch_size"]), k, control, image_size=image_size,
                                         amp=amp)
            pred, meas = pl["predicted"]["step_time_s"], statistics.median(rounds)
            self.add(case, card, model=model if image_size is None else f"{model}@{image_size}px",
                     devices=[device], source=source, amp=amp, global_batch=gb, batch_sizes=[int(r0["batch_size"])],
                     accumulation_steps=[k], micro_batch_sizes=micro, profiled_batch_sizes=ran,
                     held_out=not set(micro) <= set(ran[0]),
                     predicted_step_s=pred, measured_step_s=meas, rounds_step_s=rounds,
                     **drift_fields(p, control, ctrl, pred, meas),
                     measured="rank alone, its k micro-batches and one optimizer step, 3 warm-up + median of 5 "
                     "(CPU) or 15, median of 3 rounds; each round then the control size alike",
                     command=shlex.join(["planner", "plan", "--global-batch", str(gb), *cap_args]))

    # bench: every strategy's split is a row
    def bench(self, case: str, card: str | None, args: Sequence[str], *, source: str) -> None:
        out = self.tmp / f"{case}_{len(self.rows)}_bench.json"
        prof = self.tmp / f"{case}_{len(self.rows)}_profile.json"
        cmd = [*PLANNER, "bench", *args, "--strategies", "equal,proportional,plan", "--rounds", str(ROUNDS),
               "--quiet", "--json", str(out), "--profile-out", str(prof), "--timeout", "540"]
        _run(cmd)
        d = json.loads(out.read_text())
        meta = d["meta"]
        ran = [sorted(x) for x in meta["profile_batch_sizes"]]
        from benchmarks.summarize_bench import card_tag

        card = card or card_tag(meta["devices"])
        for name in ("equal", "proportional", "plan"):
            s = d.get(name)
            if not s or "step_time_s" not in s:
                continue
            gb = int(meta["global_batch"])
            rounds = [w["seconds"] / w["steps"] for w in s.get("rounds_window") or []] or [s["step_time_s"]]
            self.add(case, card, model=meta["model"], devices=meta["devices"], source=source, amp=bool(meta["amp"]),
                     heterogeneity=meta.get("heterogeneity"), strategy=name, global_batch=gb,
                     batch_sizes=s["batch_sizes"], accumulation_steps=s.get("accumulation_steps"),
                     profiled_batch_sizes=ran,
                     held_out=all(b not in r for b, r in zip(s["batch_sizes"], ran, strict=True)),
                     predicted_step_s=s["predicted_step_time_s"], measured_step_s=s["step_time_s"],
                     rounds_step_s=rounds, measured=f"planner bench --rounds {ROUNDS}: the split's median round "
                     "(synchronized window)", command=shlex.join(["planner", "bench", *args]))


# -- cases ----------------------------------------------------------------------------------------------------
def cpu_alone(s: Suite) -> None:
    s.alone("cpu-alone", "cpux1", "mlp", "cpu", (8, 16, 32, 64, 128), (12, 24, 48, 96, 192))
    s.alone("cpu-alone", "cpux1", "cifar_cnn", "cpu", (8, 16, 32, 64), (12, 24, 40, 48, 96))


def cpu_accum(s: Suite) -> None:
    s.accum("cpu-accum", "cpux1", "cifar_cnn", "cpu", (8, 16, 32), (40, 72, 100),
            cap_args=("--max-micro-batch", "24"), source="emulated: micro-batch cap 24 (--max-micro-batch)")


def cpu_slowdown(s: Suite) -> None:
    for factor, gb in (("2", 72), ("3", 100)):
        s.bench("cpu-slowdown", "cpux2", ["--device", "cpu", "--nproc", "2", "--model", "mlp",
                                          "--emulate-slowdown", f"1={factor}", "--global-batch", str(gb),
                                          "--quick", "--steps", "10"],
                source=f"emulated: rank 1 runs {factor}x its compute")


def cpu_loader(s: Suite) -> None:
    for nproc, gb in ((2, 64), (3, 72)):
        last = nproc - 1
        s.bench("cpu-loader", f"cpux{nproc}", ["--device", "cpu", "--nproc", str(nproc), "--model", "mlp",
                                               "--data", "loader", "--dataset", "benchmarks._slow_loader:slow_images",
                                               "--emulate-loader", f"{last}=1", "--global-batch", str(gb),
                                               "--quick"],
                source=f"emulated: rank {last} capped at 1 loader worker; every sample sleeps 3 ms in the worker")


def gpu_alone(s: Suite) -> None:
    card = "cpux1" if s.args.dry_run else "h200x1"
    s.alone("gpu-alone", card, "resnet50", "cuda:0", (8, 16, 32, 64, 128, 256), (30, 48, 120, 192), amp=True)
    s.alone("gpu-alone", card, "resnet18", "cuda:0", (16, 32, 64, 128, 256, 512), (48, 96, 192, 384), amp=True)
    s.alone("gpu-alone", card, "tiny_lm:small", "cuda:0", (4, 8, 16, 32, 64), (6, 12, 24, 48), amp=True)


def gpu_accum(s: Suite) -> None:
    card = "cpux1" if s.args.dry_run else "h200x1"
    s.accum("gpu-accum", card, "resnet50", "cuda:0", (16, 32, 64, 128), (384, 640), amp=True,
            profile_extra=("--emulate-memory", "0=12"), cap_args=(),
            source="emulated: 12 GiB of device memory (--emulate-memory 0=12)")


def cuda_cpu(s: Suite) -> None:
    devs = "cpu,cpu" if s.args.dry_run else "cuda:0,cpu"
    s.bench("cuda-cpu", None, ["--rank-devices", devs, "--model", s.model("resnet18"), "--image-size", "32",
                               "--global-batch", "128", "--quick", "--steps", "10"],
            source="real: a CUDA rank beside a CPU rank")


def shared(s: Suite) -> None:
    devs = "cpu,cpu" if s.args.dry_run else "cuda:0,cuda:0"
    s.bench("shared", "cpux2" if s.args.dry_run else "h200x1-sharedx2",
            ["--rank-devices", devs, "--model", s.model("resnet50"), *([] if s.args.dry_run else ["--amp"]),
             "--global-batch", "72" if s.args.dry_run else "300", "--quick", "--steps", "15"],
            source="real: two ranks share one GPU")


def cotenant(s: Suite) -> None:
    dev = s.dev("cuda:0")
    job = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "cotenant.py"), "--device", dev,
                            "--duty", "0.5"], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2.0)
        s.alone("cotenant", "cpux1" if s.args.dry_run else "h200x1", "resnet50", "cuda:0", (16, 32, 64, 128),
                (24, 48, 96), amp=not s.args.dry_run, source="real: benchmarks/cotenant.py --duty 0.5 on the "
                "card during profile and measurement")
    finally:
        job.terminate()
        try:
            job.wait(10)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()


CASES: dict[str, tuple[str, Callable[[Suite], None]]] = {
    "cpu-alone": ("cpu", cpu_alone), "cpu-accum": ("cpu", cpu_accum), "cpu-slowdown": ("cpu", cpu_slowdown),
    "cpu-loader": ("cpu", cpu_loader), "gpu-alone": ("gpu", gpu_alone), "gpu-accum": ("gpu", gpu_accum),
    "cuda-cpu": ("gpu", cuda_cpu), "shared": ("gpu", shared), "cotenant": ("gpu", cotenant),
}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="cpu", help=f"comma-separated: cpu, gpu, or of {', '.join(CASES)}")
    p.add_argument("--code", default="unknown", help="the code commit measured (recorded)")
    p.add_argument("--results", type=Path, default=RESULTS, help="folder for the records (default docs/results)")
    p.add_argument("--note", default="", help="a note for every record (e.g. what else ran on the host)")
    p.add_argument("--dry-run", action="store_true", help="GPU cases on cpu with mlp (checks the logic)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    names: list[str] = []
    for word in args.cases.split(","):
        picked = [n for n, (group, _) in CASES.items() if word in (n, group)]
        if not picked:
            raise SystemExit(f"--cases: unknown case {word!r}; choose cpu, gpu or {', '.join(CASES)}")
        names += [n for n in picked if n not in names]
    suite = Suite(args)
    t0 = time.perf_counter()
    failed = []
    for name in names:
        t = time.perf_counter()
        try:
            CASES[name][1](suite)
        except (RuntimeError, subprocess.TimeoutExpired, KeyError) as e:
            failed.append(name)
            print(f"case {name} failed: {e}", file=sys.stderr)
        print(f"case {name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    errs = [abs(r["error"]) for r in suite.rows]
    print(f"{len(suite.rows)} rows in {time.perf_counter() - t0:.0f} s; median |error| "
          f"{statistics.median(errs) if errs else float('nan'):.1%}; failed cases: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
