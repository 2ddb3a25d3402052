"""``PlannedRun``: the one runtime protocol -- a plan applied to one rank's training run, epoch by epoch.

Every loop runs on it: an own DDP/FSDP2 loop (``for batch in run.epoch(epoch, loader, last=...)``), the
Lightning, Accelerate, HF Trainer and Ray Train adapters (runtime.adapters), and `planner train`, which adds only
what is CLI-only (checkpoints, divergence checks, streamed loaders, step logs).  So they all write the same run log
records and make the same re-planning decisions from the same numbers.  It holds --

  * the planned sampler: ``HeteroBatchSampler`` over the plan (or, for the stock baseline ``strategy="equal"``,
    torch's ``BatchSampler(DistributedSampler)``), built once the dataset length and the rank are known, after the
    agreement check (world size, plan fingerprint, dataset length, seed and the caller's settings: a mismatch is
    one error on every rank instead of a hang);
  * the exact loss scale ``loss_scale(step, K)`` = n_i * W / n (runtime.weighting) and, in an own loop, the exact
    weighting hook with the run's opt-in gradient compression (``register_weighting``: runtime.compress);
  * the StepTimer (data wait, local compute closed on the first parameter's gradient, step time);
  * the DDP constructor keywords the plan records (``ddp_kwargs()``: runtime.ddp_settings);
  * the epoch end (collective), in two halves a client may step between:
      ``gather``   one exchange of every rank's data waits and loader workers (so each rank's statistics leave out
                   the steps a peer was late, and keep to the loaders' steady middle between their fill and drain:
                   runtime.epoch), then one of every rank's StepStats, loss, sample count, wall time, device state
                   and the client's own payload -> an ``EpochEnd``, the same on every rank;
      ``conclude`` the Replanner's decision on it (not on an unsteady epoch: runtime.epoch.unsteady_start), the
                   adopted split applied to the sampler from the next epoch, the run log's records (rank 0), and
                   one printed line per decision on rank 0, and one for the epoch's ranks slower than predicted with their causes
                   (runtime.diagnose; the record's ``diagnosis`` holds them; ``quiet=True`` silences the lines);
    ``epoch_end`` is both.

The global batch never changes, so every epoch still covers each sample exactly once.  Re-planned worker counts
are recorded in the plan; a loop that owns its DataLoader keeps its workers (one warning), `planner train`
rebuilds its loader to follow them.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from planner.devstate import DeviceState
from planner.errors import ValidationError
from planner.paths import Output, check_outputs, hold_exclusive
from planner.plan import Plan
from planner.profile import Profile
from planner.runlog import EndRecord, EpochRecord, RunLogWriter, StartRecord, predicted_step_times
from planner.stats import Diagnosis, StepStats
from runtime.collectives import all_gather_json, decide_on_rank0
from runtime.compress import check_compress
from runtime.ddp_settings import ddp_kwargs
from runtime.diagnose import diagnose, errors_of
from runtime.diagnose import line as diagnosis_line
from runtime.epoch import DEFAULT_PREFETCH, EpochEnd, loader_fill_drain, unsteady_start
from runtime.replan import ReplanDecision, Replanner
from runtime.replan.model import DEFAULT_SMOOTHING
from runtime.safety import check_agreement, check_batchnorm, first_ranks, gather_agreement
from runtime.sampler import HeteroBatchSampler
from runtime.timing import ComputeStart, StepTimer, close_compute_on_last_gradient
from runtime.weighting import WeightedHookState, loss_scale, register_weighted_hook
from runtime.workload import WorkloadCheck

T = TypeVar("T")

STRATEGIES = ("plan", "equal")
"""'plan': the HeteroBatchSampler and exact weighting; 'equal': torch's DistributedSampler + BatchSampler at the
plan's (equal) batch size, the stock baseline `planner bench` compares against (never re-planned)."""


class DeviceStateSource(Protocol):
    """What samples a rank's device and host state at each epoch end (``profiler.DeviceStateSampler``)."""

    def collect(self) -> DeviceState: ...


def _load_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    return plan if isinstance(plan, Plan) else Plan.load(plan)


class PlannedRun:
    """A plan applied to one rank's training run: sampler, loss scale, timing, re-planning, run log.

    Args:
        plan: the Plan, or the path of a plan JSON (the same on every rank).
        profile: the Profile the plan was solved from (a path or a Profile); needed by ``replan``.
        replan: re-plan between epochs from measured step times (runtime.Replanner).
        replan_threshold: adopt a new split only when it is predicted this much faster (0.05 = 5%).
        replan_smoothing: the Replanner's EMA weight of the newest epoch (None: its default).
        log_file: JSON-lines run log (rank 0 writes it; `planner report --log` reads it).
        seed: shuffle seed, the same on every rank (epoch e shuffles with seed + e, as DistributedSampler).
        shuffle, drop_last: as DistributedSampler's.
        warmup_steps: steps at each epoch start left out of the timing means.
        compress: gradient compression of the weighting hook that ``register_weighting`` registers: "none" (the
            default: the exact fp32 all-reduce), "bf16" or "fp16" (each bucket scaled by n_i / n in fp32, then cast
            and SUM-all-reduced: runtime.compress). It changes numerics, so it is on only when asked; the run log's
            start record names it.
        quiet: print nothing (by default rank 0 prints one line per re-plan decision).
        device_state: samples this rank's device and host state at every epoch end for the run log and the report
            (``profiler.DeviceStateSampler(device)``; None: not sampled).
        strategy: "plan" (the default) or "equal" (``STRATEGIES``).
        allow_workload_mismatch: run a plan made for another model, or solved from another profile than
            ``profile``, with a warning instead of the refusal (runtime.workload; `planner train
            --allow-workload-mismatch`).  Another device, host or core count is only warned either way.
        epochs: the run's epochs, when known: a re-plan that makes a compiled model recompile must save more than
            the recompile over the epochs left (runtime.Replanner's ``recompile_s``).
        recompile_s: seconds each rank takes to recompile at a new batch size (one number or one per rank; None:
            the profile's compile record, else no charge).

    The plan's DDP settings (``plan.meta["ddp"]``) are checked here: a bad one is refused before any collective.
    """

    def __init__(self, plan: Plan | str | os.PathLike[str], *, profile: Profile | str | os.PathLike[str] | None = None,
                 replan: bool = False, replan_threshold: float = 0.05, log_file: str | os.PathLike[str] | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, warmup_steps: int = 2,
                 compress: str = "none", quiet: bool = False, device_state: DeviceStateSource | None = None,
                 replan_smoothing: float | None = None, strategy: str = "plan",
                 allow_workload_mismatch: bool = False, epochs: int | None = None,
                 recompile_s: float | Sequence[float | None] | None = None) -> None:
        self.plan = _load_plan(plan)
        # Files the run reads: the run log must never be one of them (writing it would destroy the plan).
        self._inputs = {"plan": None if isinstance(plan, Plan) else os.fspath(plan),
                        "profile": None if isinstance(profile, Profile) or profile is None else os.fspath(profile)}
        self.compress = check_compress(compress)
        if strategy not in STRATEGIES:
            raise ValidationError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        if strategy == "equal" and len(set(self.plan.batch_sizes)) != 1:
            raise ValidationError(f"strategy 'equal' needs an equal split, got {list(self.plan.batch_sizes)}")
        self.strategy = strategy
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("replan", replan), ("quiet", quiet)):
            if not isinstance(value, bool):  # 'no' would read as true
                raise ValidationError(f"PlannedRun({name}=...) must be True or False, got {value!r}")
        self._ddp_kwargs = ddp_kwargs(self.plan)  # of the plan DDP is built with; a re-plan changes only batch sizes
        self._weighting: WeightedHookState | None = None
        self.profile = profile if isinstance(profile, Profile) or profile is None else Profile.load(profile)
        if replan and self.profile is None:
            raise ValidationError("replan=True needs the profile the plan came from (profile=...)")
        if self.profile is not None and self.profile.world_size != self.plan.world_size:
            raise ValidationError(f"the plan has {self.plan.world_size} ranks but the profile "
                                  f"{self.profile.world_size}; re-plan on this profile")
        # What the plan was made for (model, profile, machine) against this run: refused or warned at start.
        self._workload = WorkloadCheck(self.plan, self.profile, allow=allow_workload_mismatch)
        self.replan = replan and strategy == "plan"
        self.replan_threshold = replan_threshold
        self.replan_smoothing = replan_smoothing
        self.epochs, self.recompile_s = epochs, recompile_s
        self.log_file = log_file
        self.seed, self.shuffle, self.drop_last = int(seed), shuffle, drop_last
        self.warmup_steps = warmup_steps
        self.quiet = quiet
        self.device_state = device_state
        self.sampler: HeteroBatchSampler | None = None
        """The planned sampler (strategy 'plan'), built by ``sampler_for``."""
        self.batch_sampler: Any = None
        """What the DataLoader draws batches from: ``sampler``, or the stock BatchSampler under 'equal'."""
        self.dsampler: DistributedSampler[int] | None = None
        """The stock DistributedSampler (strategy 'equal')."""
        self.dataset_len: int | None = None
        self.timer: StepTimer | None = None
        self.replanner: Replanner | None = None
        self.rank = 0
        self.world_size = 1
        self.log = RunLogWriter(None)
        self.decisions: list[ReplanDecision] = []
        """Every re-plan decision so far (the same on every rank)."""
        self.loader_workers: int | None = None
        """This rank's training DataLoader workers, set by the adapter that built the loader, or read from the
        DataLoader ``epoch`` iterates (None: not known).  When every rank's is known, an epoch's step time is its
        last whole cycles of the job's workers between the loaders' fill and drain (runtime.epoch)."""
        self.loader_prefetch = DEFAULT_PREFETCH
        """Batches each of those workers keeps ready (the DataLoader's ``prefetch_factor``)."""
        self.follows_workers = False
        """The client rebuilds its DataLoader when a re-plan changes this rank's workers (`planner train` does; set
        it before ``sampler_for``); otherwise every re-plan keeps each rank's loader workers as they run
        (runtime.replan.Replanner's ``follow_workers``)."""
        self._first_epoch: int | None = None
        self._epoch_t0: float | None = None
        self._watched: set[int] = set()
        self._open_compute: ComputeStart | None = None
        """Opens each step's compute span at the watched DDP model's own forward (after DDP's buffer broadcast)."""
        self._finished = False
        self._warned_compress = False
        self._on_plan_states: tuple[DeviceState | None, ...] = ()
        self._on_plan_errors: dict[int, list[float]] = {}
        """Each rank's device state at the last epoch it ran on plan (runtime.diagnose's reference)."""

    # -- set-up (once the framework knows the rank and the dataset) ---------------------------------------------
    def sampler_for(self, dataset_len: int, device: torch.device | str, *, min_batch: int | None = None,
                    settings: Mapping[str, Any] | None = None, open_log: bool = True) -> Any:
        """This rank's planned batch sampler (built on the first call; collective under torch.distributed).

        Checks the plan against the launched world size and, across ranks, the plan fingerprint, dataset
        length, seed and ``settings`` (what else every rank must run alike); opens the run log and writes its
        start record on rank 0 (``open_log=False``: the caller opens it later with ``open_log``).
        ``min_batch``: the smallest batch a rank may get in the last partial step (default the plan's).
        Under strategy 'equal' it returns the stock ``BatchSampler(DistributedSampler)``.
        """
        if self.batch_sampler is not None:
            if self.dataset_len != dataset_len:
                raise ValidationError(f"the training dataset changed length ({self.dataset_len} -> "
                                      f"{dataset_len}); a planned run keeps one dataset")
            return self.batch_sampler
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = world
        if world != self.plan.world_size:
            raise ValidationError(
                f"the plan is for {self.plan.world_size} rank(s) but {world} were launched; re-plan for this world "
                "size (planner plan, or the adapter's auto mode)")
        low = self.plan.min_batch if min_batch is None else int(min_batch)
        if distributed:
            # Everything that decides which samples a rank draws or how many batches it yields: a shuffle or
            # drop_last that differs by rank loses samples or leaves a rank waiting in an all-reduce.
            check_agreement(plan_fingerprint=self.plan.fingerprint, dataset_len=dataset_len, seed=self.seed,
                            world_size=world,
                            settings={"compress": self.compress, "plan.meta.ddp": self._ddp_kwargs,
                                      "shuffle": self.shuffle, "drop_last": self.drop_last,
                                      "min_batch": low, "strategy": self.strategy, **(settings or {})})
        self._workload.check_ranks(self.rank, device)  # collective: one warning line on rank 0
        self.dataset_len = dataset_len
        if self.strategy == "equal":
            indices: Any = range(dataset_len)  # DistributedSampler only needs len()
            self.dsampler = DistributedSampler(indices, num_replicas=world, rank=self.rank, shuffle=self.shuffle,
                                               seed=self.seed, drop_last=self.drop_last)
            self.batch_sampler = BatchSampler(self.dsampler, self.plan.batch_sizes[self.rank], drop_last=False)
        else:
            self.sampler = HeteroBatchSampler.from_plan(
                self.plan, self.rank, dataset_len, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last,
                min_batch=low)
            self.sampler._first_pass_checked = True  # check_agreement above compared what it would
            self.batch_sampler = self.sampler
            # Not counted as weighting by itself: an own loop that forgets register_weighted_hook is refused at its
            # first backward (runtime.safety.arm_weighting_check); the adapters weight through loss_scale or the
            # hook, which count.
        self.timer = StepTimer(device, warmup_steps=self.warmup_steps)
        if self.replan:
            assert self.profile is not None
            self.replanner = Replanner(self.profile, self.plan, threshold=self.replan_threshold,
                                       smoothing=DEFAULT_SMOOTHING if self.replan_smoothing is None
                                       else self.replan_smoothing, follow_workers=self.follows_workers,
                                       recompile_s=self.recompile_s, epochs=self.epochs,
                                       steps_per_epoch=self.sampler.num_steps if self.sampler is not None else None)
            if self.rank == 0:  # the rank that re-solves (runtime.replan.exchange)
                # The first re-solve imports the MILP solver (scipy.optimize: 0.4 s of CPU from cached bytecode,
                # over 1 s without); paid here, at set-up, instead of inside the first epoch end, where every
                # rank would wait for it (benchmarks/own_loop_cost.py: epoch 0's end 1.26 s -> 37 ms).
                import scipy.optimize  # noqa: F401
        if open_log:
            log = self.log_file
            if log is not None:
                # Rank 0 writes the log: its checks and lock run there, and their error reaches every rank.
                decide_on_rank0(lambda: self._claim_log(os.fspath(log)))
            self.open_log(self.log_file)
        return self.batch_sampler

    def _claim_log(self, path: str) -> None:
        """`planner train`'s checks of ``--log-file`` (planner.paths): a regular file in a writable folder, never a
        FIFO, device, link or folder, never an input; then held exclusively for this run's life."""
        check_outputs([Output(flag="log_file", path=path)], self._inputs)
        hold_exclusive(path, "log_file")

    def open_log(self, path: str | os.PathLike[str] | None, *, write_start: bool = True) -> None:
        """Open the run log (rank 0 writes; the others keep a closed writer) and write its start record, unless
        ``write_start`` is False (a resumed run appends to the log it started)."""
        self.log = RunLogWriter(path, enabled=self.rank == 0)
        if write_start:
            self.log.write(StartRecord(time=time.time(), world_size=self.world_size,
                                       global_batch=self.plan.global_batch, strategy=self.strategy, plan=self.plan,
                                       grad_compress=self.compress, dataset_size=self.dataset_len,
                                       replanner=self.replanner.describe() if self.replanner is not None else None))

    def ddp_kwargs(self) -> dict[str, Any]:
        """The DDP constructor keywords the plan records, checked ({} when none): build the model's wrapper as
        ``DistributedDataParallel(model, device_ids=..., **run.ddp_kwargs())``.

        benchmarks/comm_breakdown.py --choose measures them (``bucket_cap_mb``, ``gradient_as_bucket_view``,
        ``static_graph``) and writes them to ``plan.meta["ddp"]``; none changes the update
        (runtime.ddp_settings).  A fresh dict on every call: add your own keywords to it freely.
        """
        return dict(self._ddp_kwargs)

    def register_weighting(self, ddp_model: torch.nn.parallel.DistributedDataParallel,
                           **kwargs: Any) -> WeightedHookState:
        """Register the exact weighting hook on ``ddp_model`` with the run's compression:
        ``register_weighted_hook(ddp_model, run.sampler, compress=run.compress, **kwargs)`` (after ``sampler_for``).

        ``register_weighted_hook(ddp_model, sampler)`` stays valid for an uncompressed run; with ``compress`` other
        than "none" call this instead, so the hook compresses as the run log says.
        """
        if self.sampler is None:
            raise ValidationError("run.register_weighting: build the sampler with run.sampler_for(len(dataset), "
                                  "device) first")
        if "compress" in kwargs:
            raise ValidationError("run.register_weighting: the compression is the run's (PlannedRun(compress=...))")
        self._workload.check_model(ddp_model)
        self._weighting = register_weighted_hook(ddp_model, self.sampler, compress=self.compress, **kwargs)
        return self._weighting

    def num_workers(self, default: int) -> int:
        """This rank's planned loader workers (``default`` before the sampler exists)."""
        return self.plan.ranks[self.rank].num_workers if self.batch_sampler is not None else default

    def watch(self, model: torch.nn.Module) -> None:
        """Check the plan against ``model`` and close each step's compute span when backward reaches its first
        parameter (once per model).

        A BatchNorm model needs every rank at >= 2 samples (runtime.safety.check_batchnorm): a plan giving a rank 1
        is refused here, with the fix, instead of failing inside the forward.
        """
        if id(model) in self._watched:
            return
        self._watched.add(id(model))
        self._workload.check_model(model)  # the model the plan was made for: another one is refused
        min_batch = check_batchnorm(model, self.plan.min_batch)
        low = min(self.plan.batch_sizes)
        if low < min_batch:
            raise ValidationError(
                f"the model has BatchNorm but the plan gives rank {self.plan.batch_sizes.index(low)} a batch of {low}; "
                "re-plan with min_batch=2 (planner plan --min-batch 2) or convert to SyncBatchNorm")
        if self.timer is not None:
            close_compute_on_last_gradient(model, self.timer)
            if self._open_compute is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
                # `planner train`'s rule (runtime.timing.ComputeStart): the span opens when DDP hands the batch to
                # the module, so a step this rank starts ahead of a late peer does not count the wait in DDP's
                # forward buffer broadcast as its own compute.
                self._open_compute = ComputeStart(model, self.timer)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Every rank's batch size in force (the sampler's: an adopted re-plan shows from the next epoch)."""
        return self.sampler.batch_sizes if self.sampler is not None else self.plan.batch_sizes

    # -- per step -------------------------------------------------------------------------------------------------
    def loss_scale(self, step: int, accumulation_steps: int = 1) -> float:
        """n_i * W / n for sampler step ``step`` (n: all ranks' samples in its accumulation window).

        Multiply the mean loss by it before DDP's averaging backward; with gradient accumulation over K
        micro-batches the factor already holds the 1/K (runtime.weighting.loss_scale).
        """
        if self.sampler is None:
            raise ValidationError("loss_scale: the planned sampler is not built yet (no training batch was drawn)")
        return loss_scale(self.sampler, step, accumulation_steps=accumulation_steps)

    def timed(self, batches: Iterable[T]) -> Iterator[T]:
        """Yield ``batches``, timing each step: the wait for the batch, the compute from hand-over (the body of the
        consumer's loop) to the first parameter's gradient (``watch``) or the loop's next turn, and the step."""
        timer = self.timer
        assert timer is not None, "the planned sampler is not built yet (sampler_for)"
        for batch in timer.iter_data(batches):
            if self._open_compute is not None:
                self._open_compute()  # opens at the DDP model's own forward
            else:
                timer.compute_start()  # the batch is handed over: the forward starts now
            yield batch
            timer.compute_end()  # ignored when backward reached the watched model's first parameter
            timer.step_end()

    # -- per epoch (collective) -------------------------------------------------------------------------------------
    def epoch_start(self, epoch: int) -> None:
        """Select the epoch's shuffle (and a re-plan adopted at the last epoch end); reset the timer."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        elif self.dsampler is not None:
            self.dsampler.set_epoch(epoch)
        if self.timer is not None:
            self.timer.reset()
        if self._first_epoch is None:
            self._first_epoch = epoch
            self._agree_on_start(epoch)
        self._epoch_t0 = time.perf_counter()

    def _agree_on_start(self, epoch: int) -> None:
        """Collective, at the first epoch start: every rank starts the same epoch at the same step with the same
        split -- a resume that loaded another checkpoint on some rank (or none: node-local folders) is one line
        on every rank instead of ranks training together from different positions, missing and repeating samples.
        The sampler's own first-pass check does not run under a PlannedRun (``sampler_for`` compared the rest)."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        s = self.sampler
        start = (f"epoch {epoch} at step {s.start_step} with batches {list(s.batch_sizes)}" if s is not None
                 else f"epoch {epoch}")
        starts = {r: str(payload.get("start"))[:80] for r, payload in gather_agreement({"start": start}).items()}
        firsts = first_ranks(starts)
        if len(firsts) > 1:
            listed = ", ".join(f"rank {r} starts {starts[r]}" for r in firsts[:3])
            raise ValidationError(
                f"ranks start differently: {listed}; resume every rank from the same checkpoint "
                "(run.sampler.load_state_dict(state) with the same state on every rank) and start the same epoch")

    def epoch(self, epoch: int, loader: Iterable[T], *, last: bool = False,
              loss: Callable[[], float | None] | None = None) -> Iterator[T]:
        """Your own loop's epoch: ``for batch in run.epoch(epoch, loader, last=...)`` instead of
        ``sampler.set_epoch(epoch); for batch in loader``.

        Selects the epoch's shuffle (and the split a re-plan adopted at the last epoch end), times each step --
        the wait for the batch, the compute from hand-over to the first parameter's gradient (``watch``), the step
        from one hand-over to the next -- and when the loader is exhausted runs ``epoch_end``: the stats of every
        rank, the Replanner's decision and the run log's records (collective: every rank runs the whole epoch).
        ``last`` marks the final epoch (no re-plan; the run log's end record follows).  ``loss`` is called at the
        epoch end for the epoch's loss to log (e.g. ``lambda: loss.item()``).

        The body of the loop is one training step (forward, backward, optimizer step); a DataLoader over
        ``sampler_for``'s sampler re-reads the batch sizes at every epoch, so an adopted split needs nothing more.
        """
        if self.batch_sampler is None or self.timer is None:
            raise ValidationError("run.epoch: build the loader on run.sampler_for(len(dataset), device) first")
        if isinstance(loader, DataLoader):  # its workers shape the epoch's fill and drain (runtime.epoch)
            self.loader_workers = loader.num_workers
            self.loader_prefetch = loader.prefetch_factor or DEFAULT_PREFETCH
        self.epoch_start(epoch)
        yield from self.timed(loader)
        self.epoch_end(epoch, last=last, loss=loss() if loss is not None else None)
        if last:
            self.finish(epoch + 1)

    def epoch_end(self, epoch: int, *, last: bool = False, loss: float | None = None) -> ReplanDecision | None:
        """Collective: ``gather`` the epoch, then ``conclude`` it (re-plan unless ``last``, log, print).

        ``loss``: this rank's mean loss of the epoch, for the run log (the record holds the sample-weighted mean
        over the ranks that gave one; None from any rank: not logged).  Returns the re-plan decision (None without
        re-planning); an adopted plan's batch sizes apply from the next ``epoch_start``.
        """
        if self.timer is None:
            return None
        samples = self._rank_samples()
        end = self.gather(epoch, loss_sum=None if loss is None or samples is None else float(loss) * samples,
                          samples=samples)
        return self.conclude(end, last=last).decision

    def _rank_samples(self) -> int | None:
        """This rank's samples in the epoch the timer saw: its whole share when it ran every step."""
        if self.timer is None:
            return None
        steps = self.timer.num_steps
        if self.sampler is not None:
            s = self.sampler
            if steps != len(s) or s.start_step:
                return None  # a cut or resumed epoch: not known here
            full = s.num_full_steps
            tail = s.partial_sizes()[self.rank] if s.num_steps > s.num_full_steps else 0
            return full * s.batch_sizes[self.rank] + tail
        if self.dsampler is not None:
            return len(self.dsampler) if steps == len(self.batch_sampler) else None
        return None

    def gather(self, epoch: int, *, loss_sum: float | None = None, samples: int | None = None,
               wall_s: float | None = None, job_workers: list[int] | None = None, fill_steps: int | None = None,
               drain_steps: int | None = None, streamed: bool = False, fresh: bool = True,
               extra: Any = None) -> EpochEnd:
        """Collective: every rank's view of epoch ``epoch`` (the first half of ``epoch_end``).

        ``loss_sum``/``samples``: this rank's summed loss and sample count (default: its share of the epoch, no
        loss); ``wall_s``: its wall time (default: since ``epoch_start``, the device synchronized first).
        ``job_workers``: every rank's loader workers (default: the ``loader_workers`` every rank reports, when all
        do); ``fill_steps``/``drain_steps``: its loader's fill and drain (default: ``loader_fill_drain`` of the
        busiest loader, a pipeline that starts and ends within the epoch); ``streamed``/``fresh``: the loader runs
        across epochs and this epoch started a new stream (runtime.epoch.unsteady_start).  ``extra``: any JSON the
        client exchanges with the stats (``EpochEnd.extras``, by rank).
        """
        timer = self.timer
        if timer is None:
            raise ValidationError("run.gather: build the loader on run.sampler_for(len(dataset), device) first")
        self._warn_unused_compress()
        sizes = self.batch_sizes
        # One small exchange before the summary: each rank's per-step data waits (a step a peer reached late is not
        # this rank's own speed: runtime.timing) and its loader workers (the epoch's fill, drain and worker cycle).
        peers = all_gather_json([timer.step_data_waits_s(), self.loader_workers, self.loader_prefetch])
        if job_workers is None:
            known = [p[1] for p in peers]
            job_workers = [int(w) for w in known] if None not in known else []
        if fill_steps is None or drain_steps is None:
            prefetch = max(int(p[2] or DEFAULT_PREFETCH) for p in peers)
            fill, drain = loader_fill_drain(max(job_workers), prefetch) if job_workers else (0, 0)
            fill_steps = fill if fill_steps is None else fill_steps
            drain_steps = drain if drain_steps is None else drain_steps
        mine = self.plan.ranks[self.rank]
        # The workers the loader ran (read from the DataLoader ``epoch`` iterates, or set by the adapter), else the
        # plan's: the Replanner learns the loader's cost per worker from them.
        workers = self.loader_workers if self.loader_workers is not None else mine.num_workers
        stats = timer.epoch_summary(rank=self.rank, epoch=epoch, batch_size=sizes[self.rank],
                                    num_workers=workers, peer_data_waits_s=[p[0] for p in peers],
                                    job_workers=job_workers, fill_steps=fill_steps, drain_steps=drain_steps)
        if wall_s is None and self._epoch_t0 is not None:
            if timer.device.type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize(timer.device)  # once an epoch: the wall time holds the queued work
            wall_s = time.perf_counter() - self._epoch_t0
        state = self.device_state.collect().to_dict() if self.device_state is not None else None
        loss_ok = loss_sum if loss_sum is not None and math.isfinite(loss_sum) else None
        gathered = all_gather_json([stats.to_dict(), loss_ok, samples, wall_s, state, extra])
        all_stats = tuple(StepStats.from_dict(g[0]) for g in gathered)
        # The synchronous step is as slow as its slowest rank's step-to-step interval.
        step_s = max((s.step_time_s for s in all_stats if s.num_steps > 0), default=math.nan)
        ok = math.isfinite(step_s) and step_s > 0
        counts = [g[2] for g in gathered]
        total = sum(counts) if None not in counts else None
        losses = [g[1] for g in gathered]
        loss = (math.fsum(losses) / max(total, 1) if total is not None and None not in losses else None)
        walls = [g[3] for g in gathered if g[3] is not None]
        first = epoch == self._first_epoch or self._first_epoch is None
        return EpochEnd(
            epoch=epoch, plan=self.plan, batch_sizes=tuple(sizes), stats=all_stats,
            step_time_s=step_s if ok else None, samples_per_s=sum(sizes) / step_s if ok else None, loss=loss,
            samples=total, wall_s=max(walls) if walls else None,
            device_states=tuple(None if g[4] is None else DeviceState.from_dict(g[4], strict=False) for g in gathered),
            extras=tuple(g[5] for g in gathered),
            unsteady=unsteady_start(streamed=streamed, fresh=fresh, first=first, fill=fill_steps,
                                    fill_steps=[s.fill_steps for s in all_stats]))

    def conclude(self, end: EpochEnd, *, last: bool = False, announce: bool = True) -> EpochEnd:
        """Collective (when re-planning): the second half of ``epoch_end`` -- the Replanner's decision on ``end``
        (none on the ``last`` epoch, none on an unsteady one: the next epoch decides), the adopted split given to
        the sampler for the next epoch, the run log's decision and epoch records, and (``announce``) the
        decision's one line on rank 0 (``announce_decision`` prints it later).  Returns ``end`` with the decision."""
        decision, note = None, None
        if self.replanner is not None and not last:
            if end.unsteady is not None:
                note = f"not judged: {end.unsteady}; the next one decides"
            else:
                decision = self.replanner.step(end.stats[self.rank], end.epoch)
                self.decisions.append(decision)
                self.log.write(decision.to_record())
                self._apply(decision)
        ran = end.plan
        predicted = predicted_step_times(ran)
        found = self._diagnose(end, predicted)
        self.log.write(EpochRecord(epoch=end.epoch, plan_fingerprint=ran.fingerprint,
                                   samples_per_s=end.samples_per_s, step_time_s=end.step_time_s, loss=end.loss,
                                   batch_sizes=end.batch_sizes, ranks=end.stats, predicted_step_time_s=predicted,
                                   device_state=end.device_states, wall_s=end.wall_s, samples=end.samples,
                                   diagnosis=found))
        if found and self.rank == 0 and not self.quiet:
            print(diagnosis_line(end.epoch, found), flush=True)
        done = replace(end, decision=decision, note=note)
        if announce:
            self.announce_decision(done)
        return done

    def _diagnose(self, end: EpochEnd, predicted: Sequence[float]) -> tuple[Diagnosis, ...]:
        """The epoch's slow ranks and their causes (runtime.diagnose), on the gathered data: the same on every rank.
        An unsteady epoch (warm-up, a loader's fill) is not judged; a rank's state while on plan is its reference."""
        if end.unsteady is not None:
            return ()
        found = diagnose(end.stats, predicted, end.device_states, self._on_plan_states, self._on_plan_errors)
        slow = {d.rank for d in found}
        if end.epoch != self._first_epoch:  # each rank's error on plan but at the first epoch: its drift
            for rank, err in errors_of(end.stats, predicted).items():
                if rank not in slow:
                    self._on_plan_errors.setdefault(rank, []).append(err)
        states = list(self._on_plan_states) + [None] * (len(end.device_states) - len(self._on_plan_states))
        for r, state in enumerate(end.device_states):
            if r not in slow and state is not None:
                states[r] = state
        self._on_plan_states = tuple(states)
        return found

    def announce_decision(self, end: EpochEnd) -> None:
        """Print ``end``'s decision (``ReplanDecision.line``: adopted, kept, reverted or failed, and why) or why none
        was made, in one line on rank 0, unless ``quiet``."""
        if self.rank != 0:
            return
        if end.decision is not None and end.decision.warning is not None:
            # A re-plan that failed kept the plan: a warning, shown even when quiet (the run log has it too).
            print(f"warning: {end.decision.line()}", file=sys.stderr, flush=True)
        elif self.quiet:
            return
        elif end.decision is not None:
            print(end.decision.line(), flush=True)
        elif end.note is not None:
            print(f"epoch {end.epoch}: re-plan {end.note}", flush=True)

    def _apply(self, decision: ReplanDecision) -> None:
        """The plan in force from the next epoch: an adopted (or reverted-to) plan's batch sizes go to the sampler;
        a kept plan whose prediction was re-made carries the new prediction."""
        plan = self.plan
        # A re-plan is solved from the profile corrected by the measured steps: it keeps what the run's plan was
        # made for (model, profile file, machine), so a checkpoint of it resumes against the same profile.
        if decision.adopted and decision.new_plan is not None:
            self.plan = replace(decision.new_plan, made_for=plan.made_for)
            assert self.sampler is not None
            # A client that keeps its DataLoader is re-planned at the workers it runs (``follows_workers``), so the
            # plan's worker counts are what its loader has.
            self.sampler.set_batch_sizes(self.plan.batch_sizes, self.plan.accumulation_steps)
        elif decision.repredicted is not None:  # the same split, its prediction re-made (runtime.replan)
            self.plan = replace(decision.repredicted, made_for=plan.made_for)

    def _warn_unused_compress(self) -> None:
        if self.compress != "none" and self._weighting is None and not self._warned_compress:
            self._warned_compress = True
            warnings.warn(f"PlannedRun(compress={self.compress!r}) compresses only through "
                          "run.register_weighting(ddp_model); no hook was registered that way, so the run log's "
                          "grad_compress may not describe this run", stacklevel=3)

    def finish(self, epochs: int, *, reason: str | None = None) -> None:
        """Write the run log's end record and close it (idempotent)."""
        if self._finished:
            return
        self._finished = True
        self.log.write(EndRecord(time=time.time(), epochs=epochs, reason=reason))
        self.log.close()

    def state(self) -> dict[str, Any]:
        """For logs and tests: the batch sizes in force and the decisions' outcomes."""
        return {"batch_sizes": list(self.batch_sizes), "adopted": [d.epoch for d in self.decisions if d.adopted]}
