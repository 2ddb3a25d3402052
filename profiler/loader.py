"""Dataloader cost: seconds one worker spends per sample, and throughput with 1..k workers.

``sec_per_sample`` is measured in-process, the way a DataLoader worker runs: torch limited to one thread (workers
set ``torch.set_num_threads(1)``), ``dataset[i]`` for consecutive indices (fetch, decode, transform) plus the
``default_collate`` of a batch divided by its size.  Samples are timed in chunks and the lower quartile of the
chunks is kept (interference only ever adds time, so a low quantile is the better estimate of the pipeline's own
cost; the chunks' spread goes to the rank's meta).  Wall time is used (not only CPU time)
because a worker that waits on disk is just as busy for the planner's purpose -- it produces w / c samples/s;
the thread CPU time is recorded beside it in the rank's meta.

``scaling`` runs a real ``DataLoader`` with 1..k workers (k = usable cores, or the emulated cap) for a short,
fixed time after each worker's first batch and records samples/s from the build times its workers measured: the
curve planner.loader models host contention with.

Ranks of one host that load the same dataset agree on one answer (``host_consensus``): each measures in its turn,
then they share -- the lowest sec_per_sample and, per worker count, the highest rate any of them measured (a
slower reading is another process's interference, not the pipeline) -- and record the spread they saw.  Seen
before this: one of four identical ranks measured 5.6 ms/sample vs 3.6-3.7 for its twins and was planned as
loader-bound with 20 fewer samples.
"""

from __future__ import annotations

import shutil
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, default_collate

from planner.profile import LoaderPoint, LoaderProfile
from runtime.workload import usable_cores


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderOptions:
    num_samples: int = 256
    """Samples timed in-process for sec_per_sample."""
    chunk: int = 32
    """Samples per timed chunk (the median chunk is kept) and the collate batch size."""
    budget_s: float = 4.0
    """Stop the in-process timing after this many seconds (slow pipelines), keeping >= 1 chunk."""
    scaling_s: float = 1.0
    """Seconds of timed iteration per worker count in the DataLoader scaling run (0: skip scaling)."""
    max_workers: int | None = None
    """Most workers tried in scaling (default: usable cores); the emulated cap lowers it."""
    pin: Callable[[Any], Any] | None = None
    """How the training process pins a batch, timed for the hand-over reading (``runtime.pinning.pin_tree`` for a
    loop that pins with ``PinAhead``); None: each tensor's ``Tensor.pin_memory``, as the DataLoader's pin thread."""

    @classmethod
    def quick(cls, **overrides: Any) -> LoaderOptions:
        base: dict[str, Any] = dict(num_samples=96, chunk=16, budget_s=1.5, scaling_s=0.4)
        base.update(overrides)
        return cls(**base)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderCost:
    sec_per_sample: float
    cpu_sec_per_sample: float
    samples_timed: int
    spread: float = 0.0
    """(max - min) / min over the timed chunks."""


def measure_sample_cost(dataset: Any, opts: LoaderOptions, *, clock: Callable[[], float] = time.perf_counter,
                        collate_fn: Callable[[list[Any]], Any] = default_collate) -> LoaderCost:
    """Seconds per sample of one worker: fetch+transform per item plus the collate share (median over chunks)."""
    n = min(opts.num_samples, len(dataset))
    chunk = max(1, min(opts.chunk, n))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as inside a DataLoader worker
    walls: list[float] = []
    cpus: list[float] = []
    try:
        dataset[0]  # first access may open files / build caches
        start, t_begin = 0, clock()
        while start + chunk <= n or not walls:
            idx = [(start + j) % len(dataset) for j in range(chunk)]
            w0, c0 = clock(), time.thread_time()
            collate_fn([dataset[i] for i in idx])
            walls.append((clock() - w0) / chunk)
            cpus.append((time.thread_time() - c0) / chunk)
            start += chunk
            if clock() - t_begin > opts.budget_s:
                break
    finally:
        torch.set_num_threads(threads)
    return LoaderCost(sec_per_sample=low_quartile(walls), cpu_sec_per_sample=low_quartile(cpus),
                      samples_timed=len(walls) * chunk, spread=_spread(walls))


def low_quartile(xs: list[float]) -> float:
    """The lower quartile (the value itself for fewer than 4 readings: the minimum)."""
    if len(xs) < 4:
        return float(min(xs))
    return float(statistics.quantiles(xs, n=4, method="inclusive")[0])


def _spread(xs: list[float]) -> float:
    """(max - min) / min of the readings: how much interference the measurement saw."""
    lo = min(xs)
    return float((max(xs) - lo) / lo) if lo > 0 else 0.0


class _BuildTimed(Dataset[tuple[Any, float]]):
    """``dataset[indices] -> (collated batch, seconds the worker spent building it)``: one whole batch per index
    list, built and timed inside the DataLoader worker.  (The same idea as runtime.loader_timing.TimedBatches,
    which the profiler may not import: docs/DESIGN.md, Layers.)"""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: list[int]) -> tuple[Any, float]:  # type: ignore[override]
        t0 = time.perf_counter()
        batch = self.collate_fn([self.dataset[i] for i in indices])
        return batch, time.perf_counter() - t0


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a batch (any nesting of tuples, lists and dicts)."""
    return [x for x in tree_leaves(obj) if isinstance(x, torch.Tensor)]


def _pin_rate(batch: Any, pin: Callable[[Any], Any] | None = None) -> tuple[float, int] | None:
    """(bytes per second, bytes) of pinning ``batch`` with ``pin`` (LoaderOptions.pin; None: each tensor's
    ``Tensor.pin_memory``, as the DataLoader's pin-memory thread does); None when it holds no bytes."""
    tensors = _tensors(batch)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes <= 0:
        return None
    t0 = time.perf_counter()
    if pin is not None:
        pin(batch)
    else:
        for t in tensors:
            t.pin_memory()
    return nbytes / max(time.perf_counter() - t0, 1e-9), nbytes


HANDOVER_BYTES = 256 << 20
"""Size of the batches the hand-over reading pins: large enough to run at memory speed, as a training batch does
(2x H100, 28 workers and 24 busy cores: 3.67 GB/s at 77 MB and 3.05-3.44 GB/s at 274-287 MB, against 4.1-4.7 GB/s
on 19 MB scan batches, which partly fit the CPU's caches; 2x H200 training delivered 2.5 GB/s
where the scan batches read 3.6-4.7; docs/PERFORMANCE.md)."""
HANDOVER_WORKERS = 2
"""Workers that hand the reading its big batches, as a DataLoader's do: a fresh shared-memory tensor each."""
HANDOVER_MIN_READINGS = 3
HANDOVER_MAX_EXTRA_S = 4.0
"""The scan's last worker count runs on (its workers loading the host) until the reading has
``HANDOVER_MIN_READINGS`` pins, at most this many seconds past its own time."""


class _Premade(Dataset[torch.Tensor]):
    """``dataset[i]`` -> a fresh copy of one ``nbytes`` tensor, written by the worker into shared memory as a
    collated batch is: what the training process then copies into pinned memory, without the build cost."""

    def __init__(self, nbytes: int) -> None:
        self.x = torch.ones(nbytes, dtype=torch.uint8)

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x.clone()


def _shm_free() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").free
    except OSError:
        return None


class _HandoverReader:
    """While the scan's last worker count keeps the host's cores busy: a thread draws ``HANDOVER_BYTES`` batches
    from ``HANDOVER_WORKERS`` workers and times pinning each with ``pin`` -- the training process's pin under its
    own workers' load.  Smaller where /dev/shm is small (a tenth of what is free), and nothing below 16 MiB."""

    def __init__(self, pin: Callable[[Any], Any] | None, out: list[tuple[float, int]]) -> None:
        free = _shm_free()
        self.nbytes = HANDOVER_BYTES if free is None else min(HANDOVER_BYTES, free // 10)
        self.pin, self.out = pin, out
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if self.nbytes >= 16 << 20:
            self.thread = threading.Thread(target=self._run, daemon=True, name="handover-reading")
            self.thread.start()

    def _run(self) -> None:
        loader = DataLoader(_Premade(self.nbytes), batch_size=None, num_workers=HANDOVER_WORKERS, prefetch_factor=1,
                            persistent_workers=False)
        it = iter(loader)
        try:
            for i, x in enumerate(it):
                if self.stop.is_set():
                    break
                rate = _pin_rate(x, self.pin)
                if i >= HANDOVER_WORKERS and rate is not None:  # the first ones start the workers and the pool
                    self.out.append(rate)
        finally:
            del it

    def done(self, overtime_s: float) -> bool:
        """Whether the scan may stop: ``HANDOVER_MIN_READINGS`` readings taken, or ``HANDOVER_MAX_EXTRA_S`` past
        its own time (a slow host gives fewer)."""
        return self.thread is None or len(self.out) >= HANDOVER_MIN_READINGS or overtime_s >= HANDOVER_MAX_EXTRA_S

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=30)


def measure_scaling(dataset: Any, workers: list[int], *, batch_size: int, seconds: float,
                    collate_fn: Callable[[list[Any]], Any] | None = None,
                    walls: dict[int, float] | None = None,
                    handover: list[tuple[float, int]] | None = None,
                    pin: Callable[[Any], Any] | None = None, prefetch_factor: int | None = None) -> list[LoaderPoint]:
    """samples/s of a DataLoader with each worker count: ``w * batch / mean build time`` of the batches its
    workers built in ``seconds`` of iteration, each worker's first batch (start-up, first touch) left out.  The
    mean, not the median: W workers deliver a batch per mean build time / W, slow batches included, and the run's
    epoch cost (runtime.timing) is read the same way, so profile and run measure one quantity.

    Timed in the workers, not by how fast this process drew batches: the profile runs this beside the compute
    sweep in a thread, and a sweep step that holds the GIL (a cuDNN autotune, the memory search) stalls the
    drawing -- on 2x H200, 4 workers "measured" 15 samples/s beside 564 for 2 and 1,585 for 16, and the
    plan predicted 4.7x the real loader time.  The build times still carry what the workers share (the host's
    cores, memory bandwidth, clocks), which is what the curve is for.  ``walls``, when given, gets each worker
    count's wall seconds (start-up, timing and shut-down: what the scan costs).  ``handover``, when given (a
    CUDA host), gets (bytes/s, bytes) of each big batch pinned while the last worker count runs
    (``_HandoverReader``): the training process's pin while the host's workers build at full load
    (planner.loader.handover_costs_s), pinned with ``pin`` (LoaderOptions.pin).  ``prefetch_factor``: the
    DataLoader's (None: torch's default), for big batches on a small /dev/shm (planner.cli.loader_check)."""
    out = []
    timed = _BuildTimed(dataset, collate_fn or default_collate)
    reader: _HandoverReader | None = None
    for w in workers:
        t_point = time.perf_counter()
        batches = BatchSampler(RandomSampler(range(len(dataset))), batch_size, drop_last=True)
        loader: DataLoader[tuple[Any, float]] = DataLoader(
            timed, sampler=batches, batch_size=None, num_workers=w, persistent_workers=False,
            prefetch_factor=prefetch_factor if w > 0 else None)
        builds: list[float] = []
        it = iter(loader)
        try:
            t0 = None
            for i, (_batch, build_s) in enumerate(it):
                if i < w:  # each worker's first batch: start-up is not throughput
                    continue
                if t0 is None:
                    t0 = time.perf_counter()
                builds.append(float(build_s))
                if reader is None and handover is not None and w == workers[-1]:
                    reader = _HandoverReader(pin, handover)
                elapsed = time.perf_counter() - t0
                if elapsed >= seconds and (reader is None or reader.done(elapsed - seconds)):
                    break
        finally:
            if reader is not None:
                reader.close()
                reader = None
            del it  # shuts the workers down
            if walls is not None:
                walls[w] = round(time.perf_counter() - t_point, 3)
        typical = statistics.fmean(builds) if builds else 0.0
        if typical > 0:
            out.append(LoaderPoint(num_workers=w, samples_per_s=w * batch_size / typical))
    return out


def _sample_bytes(dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> int | None:
    """Bytes one sample adds to a collated batch (of two samples, halved); None when there is none to read."""
    try:
        n = sum(t.numel() * t.element_size() for t in _tensors(collate_fn([dataset[0], dataset[1 % len(dataset)]])))
    except Exception:  # an iterable or failing dataset: no size to go by
        return None
    return round(n / 2) if n > 0 else None


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, .. up to max_workers (max_workers itself always included)."""
    out = [w for w in (1, 2, 4, 8, 16, 32, 64) if w < max_workers]
    return [*out, max_workers] if max_workers >= 1 else []


def profile_loader(dataset: Any, opts: LoaderOptions,
                   collate_fn: Callable[[list[Any]], Any] | None = None) -> tuple[LoaderProfile, dict[str, Any]]:
    """The rank's LoaderProfile plus facts for its meta (cpu seconds per sample, samples timed).

    ``collate_fn``: the user's DataLoader's (default: torch's ``default_collate``), so any batch structure works.
    """
    t0 = time.perf_counter()
    cost = measure_sample_cost(dataset, opts, collate_fn=collate_fn or default_collate)
    cost_s = time.perf_counter() - t0
    scaling: list[LoaderPoint] = []
    walls: dict[int, float] = {}
    pins: list[tuple[float, int]] | None = [] if torch.cuda.is_available() else None  # pinning needs CUDA
    k = usable_cores() if opts.max_workers is None else min(opts.max_workers, usable_cores())
    if opts.scaling_s > 0 and k >= 1:
        scaling = measure_scaling(dataset, worker_counts(k), batch_size=opts.chunk, seconds=opts.scaling_s,
                                  collate_fn=collate_fn, walls=walls, handover=pins, pin=opts.pin)
    meta: dict[str, Any] = {
        "loader_cpu_sec_per_sample": cost.cpu_sec_per_sample, "loader_samples_timed": cost.samples_timed,
        "loader_chunk_spread": round(cost.spread, 4), "loader_cost_wall_s": round(cost_s, 3),
        "loader_scaling_wall_s": {str(w): t for w, t in walls.items()}}
    handover = None
    if pins:
        # The median: a pin's end waits for the GIL when the compute sweep runs beside the scan (a high reading
        # is the copy alone, a low one that wait); the spread goes to the meta.
        rates = [r for r, _ in pins]
        handover = statistics.median(rates)
        meta.update(loader_handover_readings=len(rates), loader_handover_spread=round(_spread(rates), 4),
                    loader_handover_batch_bytes=pins[0][1])
    sample_bytes = _sample_bytes(dataset, collate_fn or default_collate) if handover is not None else None
    return LoaderProfile(sec_per_sample=cost.sec_per_sample, scaling=tuple(scaling), sample_bytes=sample_bytes,
                         handover_bytes_per_s=handover), meta


def loader_to_json(lp: LoaderProfile) -> dict[str, Any]:
    """The measured parts a host's ranks exchange (the worker cap stays each rank's own)."""
    return {"sec_per_sample": lp.sec_per_sample,
            "scaling": [[p.num_workers, p.samples_per_s] for p in lp.scaling],
            "sample_bytes": lp.sample_bytes, "handover_bytes_per_s": lp.handover_bytes_per_s}


def host_consensus(mine: LoaderProfile, peers: list[dict[str, Any]]) -> tuple[LoaderProfile, dict[str, Any]]:
    """One answer for the ranks of a host that load the same dataset (``peers``: each one's ``loader_to_json``,
    this rank's included): the lowest sec_per_sample and, per worker count, the highest measured rate; this rank
    keeps its worker cap.  The meta records this rank's own reading and the spread between the ranks'."""
    costs = [float(p["sec_per_sample"]) for p in peers]
    best: dict[int, float] = {}
    for p in peers:
        for w, r in p["scaling"]:
            best[int(w)] = max(best.get(int(w), 0.0), float(r))
    # A capped rank measured only up to its cap; it gets the whole host curve (the contention model needs the
    # host's rate at the training load), its cap still limits the workers it is given.
    handovers = [float(p["handover_bytes_per_s"]) for p in peers if p.get("handover_bytes_per_s")]
    sizes = [int(p["sample_bytes"]) for p in peers if p.get("sample_bytes")]
    shared = LoaderProfile(
        sec_per_sample=min(costs),
        scaling=tuple(LoaderPoint(num_workers=w, samples_per_s=r) for w, r in sorted(best.items())),
        max_workers=mine.max_workers,
        sample_bytes=max(sizes) if sizes else None,
        handover_bytes_per_s=max(handovers) if handovers else None,  # the fastest reading, as for the rates
    )
    meta = {"loader_own_sec_per_sample": mine.sec_per_sample, "loader_host_ranks": len(peers),
            "loader_host_spread": round(_spread(costs), 4)}
    return shared, meta
