"""What one training step needs around the model: mixed precision, memory format, gradient sync per micro-batch,
FSDP2 sharding, and the batches (a DataLoader over the plan's sampler, or synthetic ones on the device)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader

from planner.cli.distenv import DistEnv
from planner.cli.train_config import TrainConfig
from planner.errors import ValidationError
from planner.plan import Plan
from profiler.compute import use_channels_last
from profiler.workloads.specs import Workload, synthetic_batch
from runtime import epoch as epoch_rules
from runtime.loader_timing import TimedBatches, TimedLoader
from runtime.sampler import EpochStream, HeteroBatchSampler
from runtime.timing import STEADY_MIN_CYCLES


def sync_only_if(module: torch.nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """Gradient sync on a step's last micro-batch only: DDP's ``no_sync`` before it; FSDP2's
    ``set_requires_gradient_sync``; nothing to do for a bare module."""
    if last:
        if hasattr(module, "set_requires_gradient_sync"):
            module.set_requires_gradient_sync(True)  # type: ignore[operator]
        return contextlib.nullcontext()
    if isinstance(module, DDP):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        module.set_requires_gradient_sync(False)  # type: ignore[operator]
    return contextlib.nullcontext()


def fully_shard_blocks(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """FSDP2: every top-level block that holds parameters its own unit, then the root (the usual per-block
    wrapping; torchvision ResNets shard per stage)."""
    if not env.distributed:
        raise ValidationError("--fsdp needs several ranks (launch under torchrun)")
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child)
    fully_shard(model)
    return model


def autocast_for(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if not cfg.amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def channels_last_for(workload: Workload, device: torch.device, mixed: bool = False) -> bool:
    """The profiler's choice (channels_last for image models on CUDA) -- unless CPU ranks train beside CUDA
    ones: DDP requires every rank's parameters to have the same strides."""
    return use_channels_last(workload, device, False if mixed else None)


class DeviceBatches:
    """Synthetic batches on the device, indexed like the sampler's batches (the loader is not run)."""

    def __init__(self, batch_sampler: Any, workload: Workload, device: torch.device, channels_last: bool) -> None:
        self.batch_sampler = batch_sampler
        self.workload, self.device, self.cl = workload, device, channels_last
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for idx in self.batch_sampler:
            n = len(idx)
            if n not in self._cache:
                x, y = synthetic_batch(self.workload, n, self.device)
                if self.cl:
                    x = x.contiguous(memory_format=torch.channels_last)
                self._cache[n] = (x, y)
            yield self._cache[n]


class DeviceCopy:
    """Moves a loader's batch to the device on a side stream, so batch N+1's host-to-device copy runs while step N
    still computes.

    A copy issued on the compute stream waits for the queued step before it and the GPU then idles through it:
    ResNet-50's batch of 408 images is 245 MB, ~10 ms over PCIe, outside the profile's compute sweep (which steps on
    batches already on the GPU).  On 2x H100, `planner train --auto`: compute-paced steps took 10.7 ms
    (batch 408) and 5.3 ms (batch 465) longer than the slowest rank's compute plus its data wait
    (docs/PERFORMANCE.md).  The pattern is the classic
    prefetcher's: the copy allocates on the side stream without waiting for the compute stream (the source is
    pinned host memory the DataLoader handed over), the compute stream waits for the copy, and ``record_stream``
    keeps the caching allocator from reusing the batch's memory before the compute stream is done with it.  The
    channels_last conversion runs on the side stream too, and so does the normalization of uint8 images
    (``normalize``: the workload's mean and std, ``planner train --gpu-normalize``).  Tensors already on the device
    (synthetic batches) and non-CUDA devices are passed through as ``.to(device)``."""

    def __init__(self, device: torch.device, channels_last: bool = False,
                 normalize: tuple[Sequence[float], Sequence[float]] | None = None) -> None:
        self.device, self.channels_last = device, channels_last
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # uint8 images (Workload.normalize): (x / 255 - mean) / std on the device, on the side stream
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None
        if normalize is not None:
            self.mean = torch.tensor(normalize[0], device=device).view(-1, 1, 1)
            self.std = torch.tensor(normalize[1], device=device).view(-1, 1, 1)

    def _convert(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is not None and self.std is not None and x.dtype == torch.uint8:
            x = (x.float().div_(255.0) - self.mean).div_(self.std)
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stream is None or (x.device == self.device and y.device == self.device):
            return self._convert(x.to(self.device)), y.to(self.device)
        with torch.cuda.stream(self.stream):
            xd = self._convert(x.to(self.device, non_blocking=True))
            yd = y.to(self.device, non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        for t in (xd, yd):
            t.record_stream(compute)
        return xd, yd


LOADER_PREFETCH = 4
"""Batches each DataLoader worker keeps ready (``prefetch_factor``) in `planner train` and `planner bench`."""


def loader_drain_steps(workers: int, prefetch: int = LOADER_PREFETCH) -> int:
    """``runtime.epoch.loader_drain_steps`` at `planner train`'s prefetch (``LOADER_PREFETCH``)."""
    return epoch_rules.loader_drain_steps(workers, prefetch)


def loader_fill_drain(workers: int, prefetch: int = LOADER_PREFETCH) -> tuple[int, int]:
    """``runtime.epoch.loader_fill_drain`` at `planner train`'s prefetch (``LOADER_PREFETCH``)."""
    return epoch_rules.loader_fill_drain(workers, prefetch)


def steady_epoch_steps(workers: int, prefetch: int = LOADER_PREFETCH) -> int:
    """Steps an epoch needs for a steady middle the step timer can read (runtime.timing): the fill at its start,
    the drain at its end (``loader_fill_drain``) and ``STEADY_MIN_CYCLES`` whole cycles of the workers between."""
    return sum(loader_fill_drain(workers, prefetch)) + STEADY_MIN_CYCLES * max(1, workers)


def short_epoch_warning(steps_per_epoch: int, workers: list[int], prefetch: int = LOADER_PREFETCH,
                        streamed: bool = False) -> str | None:
    """A warning when an epoch is too short for a steady middle on a rank's loader (``steady_epoch_steps`` of its
    workers), else None.  ``streamed``: the loader runs across epoch boundaries (``StreamedEpochs``), so only the
    first epoch fills and only the last drains, and an epoch between needs one whole worker cycle.  Such an epoch is its loaders' fill and drain: its batches are dispatched at its start and
    built with every worker busy at once, then the GPU runs on batches built before, so its throughput and the run
    log's per-rank times are neither the loader's steady pace nor what a longer epoch would run at (on
    2x H100, 28 workers, 200-step epochs: the first 144 steps took 26-33 s with the host oversubscribed, the last 56
    ran at the GPU's pace with the workers idle)."""
    if not workers or max(workers) <= 1:
        return None
    rank = max(range(len(workers)), key=lambda i: workers[i])
    w = workers[rank]
    need = w if streamed else steady_epoch_steps(w, prefetch)
    if steps_per_epoch >= need:
        return None
    if streamed:
        return (f"warning: an epoch of {steps_per_epoch} steps is shorter than one cycle of rank {rank}'s {w} "
                f"loader workers: the run log's per-rank times are its workers' stagger, not the loader's steady "
                f"pace; give epochs of at least {need} steps (more samples or a smaller global batch) to measure it")
    fill, drain = loader_fill_drain(w, prefetch)
    return (f"warning: an epoch of {steps_per_epoch} steps has no steady middle for rank {rank}'s loader ({w} "
            f"workers: {fill} steps filling their prefetch of {prefetch} at the start, "
            f"{drain} draining at the end, two cycles of {w} between = {need} steps): its throughput and the "
            f"run log's per-rank times are the fill's and the drain's, not the loader's steady pace; give epochs "
            f"of at least {need} steps (more samples or a smaller global batch) to measure it")


def stream_drain_note(steps_per_epoch: int, epochs: int, workers: list[int], prefetch: int = LOADER_PREFETCH) -> str | None:
    """A note when the last epochs of a streamed run (``StreamedEpochs``) lie wholly in its loaders' drain, else
    None: the run's last ``workers x prefetch`` steps run on batches built before, at the GPU's pace, so those
    epochs' throughput is not the loaders' (on 2x H100, 4 epochs of 50 steps at 28 workers: epochs 2-3
    ran at the GPU's pace with 4-5 of 32 cores busy)."""
    if not workers or max(workers) < 1 or epochs < 2:
        return None
    drain = loader_fill_drain(max(workers), prefetch)[1]
    whole = min(epochs - 1, drain // max(1, steps_per_epoch))  # epochs wholly in the drain (never the first)
    if whole < 1:
        return None
    return (f"note: the run's last {drain} steps run on batches the loaders built before (their drain: {max(workers)} "
            f"workers x {prefetch} prefetched), so the last {whole} epoch(s) of {steps_per_epoch} steps show the "
            f"GPUs' pace, not the loaders'; the run log marks them (drain_steps)")


SHM_SHARE = 0.5
"""Fraction of the host's free shared memory (/dev/shm) the job's in-flight DataLoader batches may take, split
equally between the host's ranks; the rest stays for everything else on the host."""


def tensor_nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in a sample or batch (any nesting of tuples, lists and dicts)."""
    return sum(x.numel() * x.element_size() if isinstance(x, torch.Tensor)
               else int(x.nbytes) if isinstance(getattr(x, "nbytes", None), int) else 0  # numpy
               for x in tree_leaves(obj))


def pinned_pool_stats(device: torch.device) -> dict[str, float] | None:
    """The CUDA pinned-host allocator's counters (``torch.cuda.host_memory_stats``): blocks created by
    ``cudaHostAlloc`` so far, the milliseconds spent creating them and the pool's bytes -- None off CUDA or where
    this torch has no such counters.  ``pin_memory`` pins every batch the DataLoader hands over through this pool;
    a pool still growing in a steady epoch means page-locking calls in the training loop's time (pytorch#97432)."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    try:
        st = torch.cuda.host_memory_stats()
    except RuntimeError:
        return None
    return {"allocs": float(st.get("num_host_alloc", 0)),
            "alloc_ms": round(float(st.get("host_alloc_time.total", 0)) / 1e3, 3),
            "pool_mb": round(float(st.get("allocated_bytes.current", 0)) / 1e6, 1)}


class GcPauses:
    """Python's garbage collections in this process, timed (``gc.callbacks``), for the step log.

    A collection stops every Python thread of the process -- the training loop and the DataLoader's pin thread --
    for as long as it runs, and a full (generation 2) one over a big heap takes tens to hundreds of ms.  On 2x H100
    (the loader case) rank 0 waited 4.5-8.6 ms a step for data in bursts of 60-340 ms that the workers'
    build times do not explain; the step log now says whether a collection ran
    then.  ``take(t0)``: the pauses of at least ``min_ms`` since the last take, as [ms after ``t0`` (a
    ``time.perf_counter()`` reading), ms long, generation], and per generation how many collections ran in all."""

    def __init__(self, min_ms: float = 5.0) -> None:
        self.min_ms = min_ms
        self._start: float | None = None
        self._pauses: list[list[float]] = []
        self._counts = [0, 0, 0]
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
            return
        if self._start is None:
            return
        gen = int(info.get("generation", 0))
        self._counts[min(gen, 2)] += 1
        ms = 1e3 * (now - self._start)
        if ms >= self.min_ms:
            self._pauses.append([self._start, round(ms, 3), float(gen)])
        self._start = None

    def take(self, t0: float) -> dict[str, Any]:
        pauses = [[round(1e3 * (t - t0), 1), ms, int(g)] for t, ms, g in self._pauses]
        out = {"collections": list(self._counts), "pauses": pauses}
        self._pauses, self._counts = [], [0, 0, 0]
        return out

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)


def shm_free_bytes(path: str = "/dev/shm") -> int | None:
    """Free bytes of the shared memory DataLoader workers hand batches over in; None where there is none."""
    try:
        return shutil.disk_usage(path).free if os.path.isdir(path) else None
    except OSError:
        return None


def loader_prefetch(workers: int, batch_bytes: int, shm_free: int | None, local_ranks: int,
                    prefetch: int = LOADER_PREFETCH) -> tuple[int, str | None]:
    """(prefetch_factor, message): ``prefetch`` unless this rank's in-flight batches -- up to ``workers x
    prefetch`` in shared memory, plus the one the training loop and the pinning thread hold -- would not fit its
    share of the host's free /dev/shm (``SHM_SHARE`` of ``shm_free`` over ``local_ranks``); then the most that fits,
    with a note, and 1 with a warning when even that does not fit (the DataLoader would die of a bus error)."""
    if workers <= 0 or shm_free is None or batch_bytes <= 0:
        return prefetch, None
    share = SHM_SHARE * shm_free / max(1, local_ranks)
    fits = int(share // batch_bytes) - 2
    p = min(prefetch, fits // workers)
    if p >= prefetch:
        return prefetch, None
    mb, gb = batch_bytes / 2**20, shm_free / 2**30
    where = f"this rank's share of /dev/shm ({SHM_SHARE:.0%} of {gb:.1f} GiB free over {local_ranks} rank(s) on the host)"
    if p >= 1:
        return p, (f"note: DataLoader prefetch lowered from {prefetch} to {p} batches a worker, so that {workers} "
                   f"workers' batches of {mb:.0f} MiB fit {where}")
    return 1, (f"warning: {workers} workers x 1 prefetched batch of {mb:.0f} MiB do not fit {where}: the DataLoader "
               f"may die of a bus error; enlarge /dev/shm (docker: --shm-size or --ipc=host), or give this rank fewer "
               f"workers (--max-workers-per-rank {max(1, fits)}) or a smaller batch")


def make_loader(cfg: TrainConfig, workload: Workload, batch_sampler: Any, num_workers: int,
                device: torch.device, on_batch: Callable[[float], None] | None = None, batch_size: int = 0,
                say: Callable[[str], None] | None = None) -> Any:
    """The rank's batches: synthetic ones on the device, or a DataLoader over the sampler whose workers time each
    batch they build (runtime.loader_timing; ``on_batch`` gets the seconds, the loop gets the batch).

    ``batch_size``: the rank's batch (0: unknown); with it the prefetch is sized to the host's shared memory
    (``loader_prefetch``, one sample's bytes read from the dataset), and ``say`` gets the note or warning."""
    if cfg.data_on_device:
        return DeviceBatches(batch_sampler, workload, device, channels_last_for(workload, device, cfg.mixed_devices))
    if cfg.loader_workers_cap is not None:
        num_workers = min(num_workers, cfg.loader_workers_cap)
    prefetch, message = LOADER_PREFETCH, None
    if num_workers > 0 and batch_size > 0:
        try:
            sample = tensor_nbytes(workload.dataset[0])
        except Exception:  # an iterable or failing dataset: no size to go by, torch's own behaviour
            sample = 0
        prefetch, message = loader_prefetch(num_workers, sample * batch_size, shm_free_bytes(),
                                            int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if message is not None and say is not None:
        say(message)
    return TimedLoader(DataLoader(
        TimedBatches(workload.dataset),
        sampler=batch_sampler,
        batch_size=None,  # the sampler yields index lists; the worker builds (and times) the whole batch
        num_workers=num_workers,
        # pinned by the DataLoader's thread in the order the workers finish batches, so those done behind a late one
        # are pinned by the time it arrives: measured faster on a loader-fed rank than pinning in the training
        # process in step order (runtime.pinning.PinAhead) or copying from shared memory unpinned
        pin_memory=device.type == "cuda",
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch if num_workers > 0 else None,
    ), on_batch=on_batch)


class StreamedEpochs:
    """The planned sampler's batches epoch by epoch from one DataLoader iterator that lives across epoch boundaries
    (runtime.sampler.EpochStream), so that an epoch after the first starts on batches the workers built while the
    last one ended, instead of an empty pipeline (`planner train`'s default; ``--restart-loader-each-epoch`` turns
    it off).  A re-plan changes the batch sizes, which the running stream cannot: the next epoch then gets a new
    stream and DataLoader (``build``, which reads the plan in effect, workers included), and starts empty.

    ``build(stream)``: the rank's loader over that batch sampler (``make_loader``); ``last_epoch``: the epoch the
    stream stops before; ``max_steps``: every epoch cut to its first steps (``--max-steps-per-epoch``)."""

    def __init__(self, build: Callable[[Any], Any], last_epoch: int, max_steps: int | None = None) -> None:
        self.build, self.last_epoch, self.max_steps = build, last_epoch, max_steps
        self.loader: Any = None
        self._it: Iterator[Any] | None = None
        self._next: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None  # what the stream yields next

    def epoch(self, sampler: HeteroBatchSampler) -> tuple[Iterator[Any], bool]:
        """(this epoch's batches, whether its pipeline starts empty); call after ``sampler.set_epoch``.  The
        sampler begins its pass here (``begin_pass``): iterate the batches with ``micro_steps(batches, sampler)``."""
        key = (sampler.epoch, sampler.batch_sizes, sampler.accumulation_steps)
        fresh = self._it is None or key != self._next
        if fresh:
            old = self.loader
            self.loader = self.build(EpochStream(sampler, self.last_epoch, self.max_steps))
            self._it = iter(self.loader)  # the new workers start building before the old ones are shut down
            del old
        sampler.begin_pass()
        count = sampler.batches_in_pass(self.max_steps)
        self._next = (sampler.epoch + 1, sampler.batch_sizes, sampler.accumulation_steps)
        assert self._it is not None
        return itertools.islice(self._it, count), fresh

    def restart(self) -> None:
        """Start the next epoch on a new stream and DataLoader (a re-plan was adopted: sizes or workers)."""
        self._next = None

    def close(self) -> None:
        """Shut the workers down now (see ``shutdown_loader``)."""
        it, self._it, self._next = self._it, None, None
        if it is not None and hasattr(it, "close"):
            it.close()
        shutdown_loader(self.loader)
        self.loader = None


def shutdown_loader(loader: Any) -> None:
    """Stop a DataLoader's persistent workers (``loader``: a DataLoader, a TimedLoader over one, or a
    StreamedEpochs), instead of leaving them to the garbage collector: `planner train` called in-process (the
    Python API, tests) otherwise returns with its worker processes still alive, holding memory and CPU."""
    if isinstance(loader, StreamedEpochs):
        loader.close()
        return
    dataloader = getattr(loader, "loader", loader)
    iterator = getattr(dataloader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        dataloader._iterator = None


def launch_group(plan: Plan, env: DistEnv) -> Any:
    """The process group DDP reduces over: the default one, unless the plan records a launch setting that the
    default group was not started with (`--auto`, `planner bench`: the plan came after the group) -- then a new
    NCCL group configured as that setting (profiler.comm.nccl_group_for: the same communicator config)."""
    if not plan.launch_env or env.backend != "nccl" or all(os.environ.get(k) == v for k, v in plan.launch_env.items()):
        return None
    import torch.distributed as dist

    from profiler.comm import nccl_group_for

    # One group per setting and default group: `planner bench` trains once per strategy and round in one process,
    # and a communicator per call was never destroyed.  Every rank asks in the same order (the same plan), so the
    # collective new_group runs on all of them or on none.
    key = tuple(sorted(plan.launch_env.items()))
    world, groups = _LAUNCH_GROUPS.get("world"), _LAUNCH_GROUPS.setdefault("groups", {})
    if world is not dist.group.WORLD:
        groups.clear()
        _LAUNCH_GROUPS["world"] = dist.group.WORLD
    if key not in groups:
        groups[key] = nccl_group_for(plan.launch_env)
    return groups[key]


_LAUNCH_GROUPS: dict[str, Any] = {}
"""launch_group's cache: "world" -> the default group it was built under, "groups" -> setting -> group."""
