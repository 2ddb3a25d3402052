"""`planner bench`'s options: one frozen, checked ``BenchOptions`` built once from the command line and handed to
every rank (planner/cli/bench.py)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from planner.argcheck import GPU_NORMALIZE_CHOICES, check_ranks
from planner.errors import ValidationError

STRATEGIES = ("equal", "equal-accum", "no-accum", "proportional", "plan", "plan+replan")
DEFAULT_STRATEGIES = ("equal", "proportional", "plan", "plan+replan")
"""equal-accum (the same micro-batch on every rank at the smallest memory cap, the same accumulation everywhere:
what users do by hand on mixed memory) and no-accum (the best plan without accumulation) are for memory-capped
runs (--emulate-memory)."""
DATA = ("device", "loader")


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """What one `planner bench` compares and how; checked on construction, each error one line naming its flag."""

    nproc: int = 2
    """Ranks launched on this host (``--nproc``)."""
    device: str = "auto"
    rank_devices: str | None = None
    model: str = "cifar_cnn"
    """Resolved: ``--model``, else resnet50 on CUDA and cifar_cnn on CPU (``from_args``)."""
    dataset: str = "fake"
    data: str = "device"
    """'device': synthetic batches made on the device (compute only); 'loader': the real DataLoader."""
    image_size: int | None = None
    gpu_normalize: str = "auto"
    num_samples: int | None = None
    global_batch: int = 64
    """Resolved: ``--global-batch``, else 512 on CUDA and 64 on CPU; a multiple of ``nproc``."""
    steps: int = 15
    """Timed steps per strategy and epoch; resolved: ``--steps``, else 30 on CUDA and 15 on CPU; at least 2."""
    rounds: int = 1
    replan_epochs: int = 4
    amp: bool = False
    quick: bool = False
    emulate_slowdown: str | None = None
    emulate_loader: str | None = None
    emulate_memory: str | None = None
    late_slowdown: str | None = None
    sweep_slowdown: tuple[str | None, ...] = ()
    """The ``--emulate-slowdown`` specs of a sweep, one comparison each (empty: no sweep)."""
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    loader_check_s: float | None = None
    label: str | None = None
    timeout_s: float = 1800.0
    json_path: str | None = None
    profile_out: str | None = None
    step_log: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        from profiler.workloads.emulate import parse_rank_floats, parse_rank_gib, parse_rank_ints

        for flag, value, low in (("--nproc", self.nproc, 1), ("--global-batch", self.global_batch, 1),
                                 ("--steps", self.steps, 1), ("--rounds", self.rounds, 1),
                                 ("--replan-epochs", self.replan_epochs, 1), ("--image-size", self.image_size, 1),
                                 ("--num-samples", self.num_samples, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValidationError(f"{flag}: must be an integer >= {low}, got {value!r}")
        if self.data not in DATA:
            raise ValidationError(f"--data: unknown {self.data!r}; choose from {', '.join(DATA)}")
        if self.gpu_normalize not in GPU_NORMALIZE_CHOICES:
            raise ValidationError(f"--gpu-normalize: unknown {self.gpu_normalize!r}; choose from "
                                  f"{', '.join(GPU_NORMALIZE_CHOICES)}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValidationError(f"--timeout: must be > 0, got {self.timeout_s}")
        if self.loader_check_s is not None and not (math.isfinite(self.loader_check_s)
                                                    and 0 <= self.loader_check_s <= 600):
            raise ValidationError(f"--loader-check-s: must be in [0, 600], got {self.loader_check_s}")
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise ValidationError(f"--strategies: unknown {bad[0]!r}; choose from {', '.join(STRATEGIES)}" if bad
                                  else f"--strategies: none given; choose from {', '.join(STRATEGIES)}")
        for flag, rank_map in (("--emulate-slowdown", parse_rank_floats(self.emulate_slowdown)),
                               ("--emulate-loader", parse_rank_ints(self.emulate_loader)),
                               ("--emulate-memory", parse_rank_gib(self.emulate_memory)),
                               ("--late-slowdown", parse_rank_floats(self.late_slowdown, flag="--late-slowdown"))):
            check_ranks(rank_map, self.nproc, flag)
        for spec in self.sweep_slowdown:
            check_ranks(parse_rank_floats(spec), self.nproc, "--sweep-slowdown")
        if self.global_batch % self.nproc:
            raise ValidationError(
                f"--global-batch {self.global_batch} is not a multiple of {self.nproc} ranks: the equal split "
                "(DistributedSampler) needs one")
        if self.steps < 2:
            raise ValidationError(f"--steps {self.steps}: the timed window opens after an epoch's first step and "
                                  "needs at least one more; give 2 or more")

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, cuda: bool) -> BenchOptions:
        """The options of a parsed command line; unset sizes get the defaults of the device kind (``cuda``)."""

        def given(value: Any, default: Any) -> Any:  # `value or default` read an explicit 0 as "the default"
            return default if value is None else value

        return cls(
            nproc=args.nproc, device=args.device, rank_devices=args.rank_devices,
            model=given(args.model, "resnet50" if cuda else "cifar_cnn"), dataset=args.dataset, data=args.data,
            image_size=args.image_size, gpu_normalize=args.gpu_normalize, num_samples=args.num_samples,
            global_batch=given(args.global_batch, 512 if cuda else 64), steps=given(args.steps, 30 if cuda else 15),
            rounds=args.rounds, replan_epochs=args.replan_epochs, amp=args.amp, quick=args.quick,
            emulate_slowdown=args.emulate_slowdown, emulate_loader=args.emulate_loader,
            emulate_memory=args.emulate_memory, late_slowdown=args.late_slowdown,
            sweep_slowdown=tuple(x.strip() or None for x in args.sweep_slowdown.split(";"))
            if args.sweep_slowdown else (),
            strategies=tuple(s.strip() for s in args.strategies.split(",") if s.strip()),
            loader_check_s=args.loader_check_s, label=args.label, timeout_s=args.timeout, json_path=args.json,
            profile_out=args.profile_out, step_log=args.step_log, quiet=args.quiet)

    @property
    def on_device(self) -> bool:
        return self.data == "device"

    @property
    def mixed_devices(self) -> bool:
        """Some ranks on CPU and some on CUDA (gloo; one memory format everywhere)."""
        return bool(self.rank_devices) and "cpu" in self.rank_devices and "cuda" in self.rank_devices  # type: ignore[operator]

    def runs(self) -> list[BenchOptions]:
        """One comparison per ``--sweep-slowdown`` spec (as its ``--emulate-slowdown``), else this one."""
        if not self.sweep_slowdown:
            return [self]
        return [dataclasses.replace(self, emulate_slowdown=spec, sweep_slowdown=()) for spec in self.sweep_slowdown]

    def slowdown(self, rank: int) -> float:
        from profiler.workloads.emulate import parse_rank_floats

        return parse_rank_floats(self.emulate_slowdown).get(rank, 1.0)

    def late(self, rank: int) -> float | None:
        from profiler.workloads.emulate import parse_rank_floats

        return parse_rank_floats(self.late_slowdown, flag="--late-slowdown").get(rank)

    def loader_cap(self, rank: int) -> int | None:
        from profiler.workloads.emulate import parse_rank_ints

        return parse_rank_ints(self.emulate_loader).get(rank)

    def memory_gib(self, rank: int) -> float | None:
        from profiler.workloads.emulate import parse_rank_gib

        return parse_rank_gib(self.emulate_memory).get(rank)

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the partial file's ``options``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
