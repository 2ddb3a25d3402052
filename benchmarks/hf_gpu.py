"""The HF Trainer's default vs its planned twin on 2 GPUs for a ~110M-parameter causal LM, rank 1 emulated F x slower.

    torchrun --standalone --nproc-per-node 2 benchmarks/hf_gpu.py                 # 2 GPUs: F = 2 and 3, 3 rounds
    torchrun --standalone --nproc-per-node 2 benchmarks/hf_gpu.py --tiny          # the logic on CPU in ~1 minute

In one launch (same processes, same warm-up for every variant):
  1. per slowdown F (default 2 and 3): profiler.api.profile_job of the very step both variants run (profiler.workloads.lm
     ``tiny_lm:125m`` -- GPT-2-small shape, 110M parameters, packed sequences of 1024 tokens, bf16 autocast,
     AdamW; rank 1 repeats forward+backward to take F x its compute, profiler.workloads.emulate.Slowdown), then
     then the Trainer's own per-step overhead (runtime.adapters.hf.measure_trainer_overhead: a scratch stock
     Trainer at the equal split, --warmup + --calibrate-steps steps, planner.calibrate_overhead), then
     planner.solve at the global batch -> the plan; the profile, the plan and the uncalibrated plan land in the
     JSON (the default's and planned-equal's predictions are at the calibrated split: in-sample);
  2. rounds (default 3), interleaved: for each F, ``default`` -- the HF Trainer as shipped: its own
     DistributedSampler through accelerator.prepare, ``per_device_train_batch_size`` = B / 2 on both ranks -- then
     ``planned`` -- runtime.adapters.hf.planned_trainer (the plan's per-rank batches, exact token weighting) --
     then ``planned-equal`` -- the planned trainer on the equal split, so the adapter's own cost shows apart from
     the split's (its prediction is the profile's equal split; ``--variants default,planned`` leaves it out);
  3. each run is one epoch of ``--steps`` optimizer steps through ``Trainer.train()``; the timed window runs from
     the end of step ``--warmup`` to the end of the last step, synchronized (cuda.synchronize + barrier) at both
     ends (runtime.adapters.hf.step_window); samples/s = B x timed steps / window, tokens/s = samples/s x sequence length.
Reports per F the median speed-up planned / default over rounds with min-max (goal >= 1.7x at F = 3) and the
prediction error (measured planned samples/s vs the plan's prediction; goal within 5%), and writes the raw
per-round numbers, profiles and plans to $OUT/hf_gpu.json (or --json).

Wall time: about 108 s on 2x H200 for F = 2, 3 with the default and planned variants (2 profiles ~37 s);
planned-equal adds a third run to every round (about 40 s more). The run prints its own total.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Trainer, TrainingArguments

import planner
from profiler.api import batches_from, profile_job
from profiler.sweep import SweepOptions
from profiler.workloads.emulate import Slowdown
from profiler.workloads.lm import FakeText, TinyLM, lm_config, lm_loss
from runtime.adapters.hf import measure_trainer_overhead, planned_trainer, step_window

SLOW_RANK = 1


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """profiler.workloads.lm.FakeText as the dict batches a Trainer feeds: {"input_ids", "labels"} (labels already the next
    tokens, -100 on padding; packed by default)."""

    def __init__(self, n: int, seq_len: int, vocab_size: int) -> None:
        self.text = FakeText(n, seq_len, vocab_size)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.text[i]
        return {"input_ids": ids, "labels": labels}


class LMWithLoss(nn.Module):
    """tiny_lm returning its token-mean loss, as a Trainer model must."""

    def __init__(self, size: str, seq_len: int) -> None:
        super().__init__()
        self.lm = TinyLM(lm_config(f"tiny_lm:{size}"), seq_len)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": lm_loss(self.lm(input_ids), labels)}


def emulate(model: nn.Module, batch: dict[str, torch.Tensor], slow: Slowdown, amp: bool) -> None:
    """Rank 1's extra forward+backward passes on the unwrapped LM (gradients dropped), in bf16 like the real one."""
    inner = getattr(model, "module", model)
    with torch.autocast(batch["input_ids"].device.type, dtype=torch.bfloat16, enabled=amp):
        slow.apply(inner.lm, lm_loss, batch["input_ids"], batch["labels"])


class SlowTrainer(Trainer):  # type: ignore[misc]
    """The Trainer both variants run: rank 1 does its emulated extra work before the real forward."""

    slow = Slowdown(1.0)
    amp = False

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if model.training:
            emulate(model, inputs, self.slow, self.amp)
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


def make_trainer(variant: str, factor: float, plan: planner.Plan, args: argparse.Namespace, dev: torch.device,
                 callbacks: list[Any]) -> Any:
    """The Trainer of one run: ``default`` (stock) or ``planned``, a fresh model, one epoch of ``args.steps`` steps."""
    torch.manual_seed(0)
    model = LMWithLoss(args.size, args.seq_len)
    data = Tokens(args.steps * args.global_batch, args.seq_len, lm_config(f"tiny_lm:{args.size}").vocab_size)
    targs = TrainingArguments(
        output_dir=str(Path(args.tmp) / "trainer"), per_device_train_batch_size=args.global_batch // 2,
        num_train_epochs=1, learning_rate=1e-4, warmup_steps=0, bf16=args.amp, use_cpu=dev.type == "cpu",
        ddp_backend="nccl" if dev.type == "cuda" else "gloo", ddp_find_unused_parameters=False,
        dataloader_num_workers=args.workers, dataloader_pin_memory=dev.type == "cuda", report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, seed=0)
    kw: dict[str, Any] = {"model": model, "args": targs, "train_dataset": data, "callbacks": callbacks}
    if variant == "planned":
        trainer = planned_trainer(plan, trainer_cls=SlowTrainer, num_workers=args.workers, **kw)
    else:
        trainer = SlowTrainer(**kw)
    trainer.slow = Slowdown(factor if dist.get_rank() == SLOW_RANK else 1.0)
    trainer.amp = args.amp
    return trainer


def free(dev: torch.device) -> None:
    """Each run builds its own 110M model and AdamW state: free them before the next one allocates."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def run(variant: str, factor: float, plan: planner.Plan, args: argparse.Namespace, dev: torch.device) -> float:
    """One epoch of ``args.steps`` steps through Trainer.train(); returns the timed window's samples/s."""
    window = step_window(dev, args.warmup, args.steps)
    trainer = make_trainer(variant, factor, plan, args, dev, [window])
    trainer.train()
    assert trainer.state.global_step == args.steps, (variant, trainer.state.global_step)
    sps = args.global_batch * (args.steps - args.warmup) / window.seconds
    del trainer
    free(dev)
    return sps


def profile_and_plan(factor: float, args: argparse.Namespace, dev: torch.device
                     ) -> tuple[Any, planner.Plan, float, planner.Plan]:
    """profiler.api on the step the runs train (rank 1 F x slower), then -- unless --no-calibrate -- the stock
    Trainer's own loop overhead (runtime.adapters.hf.measure_trainer_overhead: a scratch Trainer at the equal
    split, its own short run, before any measured run), solved at the global batch on every rank.  Returns the
    calibrated profile and plan, the seconds, and the plan of the profiler's own profile (the uncalibrated model;
    the calibrated profile's ``meta.exposed_calibration`` holds what the calibration changed)."""
    slow = Slowdown(factor if dist.get_rank() == SLOW_RANK else 1.0)
    data = Tokens(1024, args.seq_len, lm_config(f"tiny_lm:{args.size}").vocab_size)

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        emulate(model, batch, slow, args.amp)
        return model(**batch)["loss"]  # type: ignore[no-any-return]

    t0 = time.perf_counter()
    sweep = (SweepOptions.quick if args.tiny else SweepOptions)(max_batch=args.global_batch)
    # No loader measurement (data=None): synthetic token ids cost ~30 us a sequence, far from a 1024-token step,
    # and its scaling run over every worker count would take longer than the whole benchmark.
    profile = profile_job(lambda: LMWithLoss(args.size, args.seq_len), batches_from(data), loss_fn, dev,
                          optimizer_fn=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4), amp=args.amp,
                          model_name=f"tiny_lm:{args.size}", sweep=sweep)
    raw_plan = planner.solve(profile, global_batch=args.global_batch, min_gain=0.0)
    calibrated = profile
    if args.calibrate:
        scratch = make_trainer("default", factor, raw_plan, args, dev, [])
        calibrated = measure_trainer_overhead(profile, scratch, steps=args.calibrate_steps,
                                              warmup=args.warmup)
        del scratch
        free(dev)
    plan = planner.solve(calibrated, global_batch=args.global_batch, min_gain=0.0)
    return calibrated, plan, time.perf_counter() - t0, raw_plan


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--size", default="125m", help="tiny_lm size: tiny, small, 125m (default 125m, ~110M params)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (packed)")
    p.add_argument("--global-batch", type=int, default=48, metavar="B", help="sequences per optimizer step")
    p.add_argument("--factors", default="2,3", help="slowdowns of rank 1 to run, comma-separated")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (one epoch)")
    p.add_argument("--warmup", type=int, default=8, help="steps before the timed window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="default,planned,planned-equal",
                   help="what each round runs per F, in this order (default, planned are required)")
    p.add_argument("--workers", type=int, default=2, help="loader workers per rank (both variants)")
    p.add_argument("--no-amp", dest="amp", action="store_false", help="float32 instead of bf16")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="predict from the profiler's own DDP loop only (no Trainer overhead calibration)")
    p.add_argument("--calibrate-steps", type=int, default=12, help="timed steps of the calibration run")
    p.add_argument("--tiny", action="store_true",
                   help="CPU dry run of the logic: tiny_lm:tiny, 64 tokens, B 8, 5 steps, 1 round, quick profile")
    p.add_argument("--json", default=None, help="output JSON (default $OUT/hf_gpu.json)")
    p.add_argument("--tmp", default=None, help="scratch folder for the Trainer's output_dir (default: a temp dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.tiny:
        args.device, args.size, args.seq_len, args.global_batch = "cpu", "tiny", 64, 8
        args.steps, args.warmup, args.rounds, args.workers, args.amp = 5, 2, 1, 0, False
        args.calibrate_steps = 2
    if args.tmp is None:
        import tempfile

        args.tmp = tempfile.mkdtemp(prefix="hf_gpu_")
    t_start = time.perf_counter()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")  # the Trainer's accelerate state reuses it
    rank = dist.get_rank()
    factors = [float(f) for f in args.factors.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not {"default", "planned"} <= set(variants) or not set(variants) <= {"default", "planned", "planned-equal"}:
        raise SystemExit(f"--variants {args.variants}: default and planned, and optionally planned-equal")

    setups: dict[float, dict[str, Any]] = {}
    for f in factors:
        profile, plan, profile_s, raw_plan = profile_and_plan(f, args, dev)
        equal = planner.evaluate(profile, planner.equal_split(args.global_batch, dist.get_world_size()),
                                 method="equal")
        setups[f] = {"profile": profile, "plan": plan, "equal": equal, "profile_s": profile_s,
                     "raw_plan": raw_plan}
        if rank == 0:
            pred = plan.predicted
            print(f"F={f:g}: profiled in {profile_s:.0f} s; plan {list(plan.batch_sizes)}, predicted "
                  f"{pred.samples_per_s:.1f} samples/s = {pred.samples_per_s / pred.equal_split_samples_per_s:.2f}x "
                  "equal split", flush=True)

    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for f in factors:
            res: dict[str, Any] = {"round": r, "factor": f}
            for variant in variants:
                plan = setups[f]["equal" if variant == "planned-equal" else "plan"]
                sps = run("default" if variant == "default" else "planned", f, plan, args, dev)
                res[variant] = {"samples_per_s": sps, "tokens_per_s": sps * args.seq_len}
            res["speedup"] = res["planned"]["samples_per_s"] / res["default"]["samples_per_s"]
            rounds.append(res)
            if rank == 0:
                eq = f"  planned-equal {res['planned-equal']['samples_per_s']:.1f}" if "planned-equal" in res else ""
                print(f"round {r} F={f:g}: default {res['default']['samples_per_s']:.1f}  planned "
                      f"{res['planned']['samples_per_s']:.1f}{eq} samples/s  {res['speedup']:.3f}x", flush=True)

    if rank == 0:
        summary = {}
        for f in factors:
            mine = [x for x in rounds if x["factor"] == f]
            ups = [x["speedup"] for x in mine]
            planned_sps = statistics.median(x["planned"]["samples_per_s"] for x in mine)
            default_sps = statistics.median(x["default"]["samples_per_s"] for x in mine)
            pred = setups[f]["plan"].predicted
            summary[f"{f:g}"] = {
                "median_speedup": statistics.median(ups), "min_speedup": min(ups), "max_speedup": max(ups),
                "median_default_samples_per_s": default_sps, "median_planned_samples_per_s": planned_sps,
                "median_planned_tokens_per_s": planned_sps * args.seq_len,
                "predicted_samples_per_s": pred.samples_per_s,
                "predicted_equal_split_samples_per_s": pred.equal_split_samples_per_s,
                "prediction_error": planned_sps / pred.samples_per_s - 1.0,
                "step_prediction_error": pred.samples_per_s / planned_sps - 1.0,
                "uncalibrated_prediction_error": planned_sps / setups[f]["raw_plan"].predicted.samples_per_s - 1.0,
                "calibration": setups[f]["profile"].meta.get("exposed_calibration"),
                "default_vs_equal_prediction": default_sps / pred.equal_split_samples_per_s - 1.0,
                "plan_batch_sizes": list(setups[f]["plan"].batch_sizes)}
            s = summary[f"{f:g}"]
            if "planned-equal" in variants:  # the adapter at the default's split: its own cost, and its prediction
                pe_sps = statistics.median(x["planned-equal"]["samples_per_s"] for x in mine)
                s["median_planned_equal_samples_per_s"] = pe_sps
                s["planned_equal_vs_default"] = statistics.median(
                    x["planned-equal"]["samples_per_s"] / x["default"]["samples_per_s"] for x in mine)
                s["planned_equal_prediction_error"] = pe_sps / pred.equal_split_samples_per_s - 1.0
            print(f"F={f:g}: planned / HF default = {s['median_speedup']:.3f}x (min {s['min_speedup']:.3f}, max "
                  f"{s['max_speedup']:.3f}) over {len(ups)} rounds; planned {planned_sps * args.seq_len:.0f} tokens/s;"
                  f" prediction error {100 * s['prediction_error']:+.1f}% (uncalibrated "
                  f"{100 * s['uncalibrated_prediction_error']:+.1f}%)", flush=True)
        total_s = time.perf_counter() - t_start
        out = Path(args.json or Path(os.environ.get("OUT", ".")) / "hf_gpu.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "benchmark": "hf_gpu", "args": vars(args), "world_size": dist.get_world_size(),
            "heterogeneity": f"emulated compute skew: rank {SLOW_RANK} x F (profiler.workloads.emulate.Slowdown)",
            "emulate_mode": Slowdown(2.0).mode,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "total_s": total_s,
            "setups": {f"{f:g}": {"profile_s": s["profile_s"], "plan": s["plan"].to_dict(),
                                  "equal_plan": s["equal"].to_dict(), "profile": s["profile"].to_dict(),
                                  "uncalibrated_plan": s["raw_plan"].to_dict()}
                       for f, s in setups.items()},
            "rounds": rounds, "summary": summary}, indent=1))
        print(f"wrote {out} ({total_s:.0f} s in all)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
