"""Profiling the compiled step: the sweep's training steps run through ``torch.compile``.

``compile_runner(runner, CompileOptions(...))`` makes a ``profiler.compute.TimedSteps`` step through
``torch.compile(model, mode=..., backend=...)`` (the optimizer and the recorded model stay the eager module's: the
compiled wrapper shares its parameters).  With ``dynamic_batch`` (the default) dim 0 of every tensor in a batch is
marked dynamic (``torch._dynamo.mark_dynamic``) before the batch's first step, so the first compile makes a graph
whose batch dimension is symbolic and later sizes reuse it.  A batch of 1 is marked only ``maybe_mark_dynamic``:
dynamo specializes sizes 0 and 1, so batch 1 compiles a graph of its own (older torch refuses ``mark_dynamic``
on a size-1 dimension).

Per batch size, the first step at that size is timed apart from the sweep's steps (an extra step before the
point's warm-up, in none of its medians), with dynamo's graph counter (``torch._dynamo.utils.counters["stats"]
["unique_graphs"]``: graphs dynamo compiled, a graph break counting each piece) read before and after it.  The
record (``CompiledStep.record``, written to ``ranks[i].meta.compile``, docs/DESIGN.md):

  * ``first_s``: the first size's first step minus that point's median compiled step (the compile);
  * ``recompile_s``: the largest such excess at a later size whose first step compiled a graph (0.0: none did);
  * ``recompiles``: graphs compiled at sizes after the first; ``sizes``: the sizes run compiled, in the order run
    (the sweep, then the memory search); ``recompiled_sizes``: the later sizes that compiled a graph.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.errors import ValidationError
from profiler.sweep import DoesNotFit, Measurement

if TYPE_CHECKING:
    import torch

    from profiler.compute import TimedSteps

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes (``planner profile --compile MODE``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileOptions:
    mode: str = "default"
    """torch.compile's ``mode`` (one of COMPILE_MODES)."""
    backend: str = "inductor"
    """torch.compile's ``backend`` (``"inductor"``; ``"aot_eager"`` or ``"eager"`` capture without code generation)."""
    dynamic_batch: bool = True
    """Mark dim 0 of every batch tensor dynamic before its first step (one graph for every size >= 2).  False:
    ``torch.compile(dynamic=False)``, every new size compiles a graph (static shapes, as CUDA graphs need)."""

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise ValidationError(f"compile mode {self.mode!r} is not one of torch.compile's: {', '.join(COMPILE_MODES)}")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValidationError(f"compile backend must be a name like 'inductor' or 'aot_eager', got {self.backend!r}")


def compile_options(compile: bool | str | None, backend: str = "inductor", *,
                    dynamic_batch: bool = True) -> CompileOptions | None:
    """``profile_step(compile=...)``: None/False -> None (eager); True -> mode "default"; a mode name -> that mode."""
    if compile is None or compile is False:
        return None
    mode = "default" if compile is True else compile
    if not isinstance(mode, str):
        raise ValidationError(f"compile must be None, True or a torch.compile mode ({', '.join(COMPILE_MODES)}), "
                              f"got {compile!r}")
    return CompileOptions(mode=mode, backend=backend, dynamic_batch=dynamic_batch)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (``counters["stats"]["unique_graphs"]``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def mark_batch_dynamic(batch: Any) -> None:
    """Mark dim 0 of every tensor inside ``batch`` (tuples, lists, dicts) dynamic for dynamo."""
    import torch
    import torch._dynamo

    if isinstance(batch, torch.Tensor):
        if batch.dim() >= 1:
            if batch.shape[0] >= 2:
                torch._dynamo.mark_dynamic(batch, 0)
            else:  # sizes 0 and 1 are specialized: a hint, not a demand
                torch._dynamo.maybe_mark_dynamic(batch, 0)
    elif isinstance(batch, dict):
        for v in batch.values():
            mark_batch_dynamic(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            mark_batch_dynamic(v)


class CompiledStep:
    """The compiled module a TimedSteps steps through, and what its first step at each batch size cost."""

    def __init__(self, model: torch.nn.Module, options: CompileOptions) -> None:
        import torch

        self.options = options
        dynamic = None if options.dynamic_batch else False
        self.module: torch.nn.Module = torch.compile(  # type: ignore[assignment]
            model, mode=None if options.mode == "default" else options.mode, backend=options.backend, dynamic=dynamic)
        self.sizes: list[int] = []
        self._excess: dict[int, float] = {}
        self._graphs: dict[int, int] = {}

    def mark(self, batch: Any) -> None:
        if self.options.dynamic_batch:
            mark_batch_dynamic(batch)

    def measure(self, runner: TimedSteps, batch_size: int, warmup: int, repeats: int,
                inner: Callable[[int, int, int], Measurement]) -> Measurement:
        """``inner(batch_size, warmup, repeats)``, preceded at a new size by one step timed apart (its compile)."""
        import torch

        if batch_size in self._excess:
            return inner(batch_size, warmup, repeats)
        oom = False
        try:
            batch = runner.batch_for(batch_size)
            before = compiled_graphs()
            first = runner.timed_step(batch)
            graphs = compiled_graphs() - before
        except torch.cuda.OutOfMemoryError:
            oom = True
        if oom:
            batch = None
            runner.free()
            raise DoesNotFit(batch_size)
        m = inner(batch_size, warmup, repeats)  # the warm-up the sweep asked for still follows the compile
        self.sizes.append(batch_size)
        self._excess[batch_size] = max(0.0, first - float(statistics.median(m.times_s)))
        self._graphs[batch_size] = graphs
        return m

    def record(self) -> dict[str, Any]:
        """``ranks[i].meta.compile`` (module docstring)."""
        later = self.sizes[1:]
        recompiled = [b for b in later if self._graphs[b] > 0]
        return {
            "mode": self.options.mode,
            "backend": self.options.backend,
            "dynamic": "batch" if self.options.dynamic_batch else None,
            "first_s": round(self._excess[self.sizes[0]], 4) if self.sizes else None,
            "recompile_s": round(max((self._excess[b] for b in recompiled), default=0.0), 4),
            "recompiles": sum(self._graphs[b] for b in later),
            "sizes": list(self.sizes),
            "recompiled_sizes": recompiled,
        }


def compile_runner(runner: TimedSteps, options: CompileOptions | None) -> TimedSteps:
    """``runner`` stepping through torch.compile (options None: unchanged)."""
    if options is not None:
        runner.compiled = CompiledStep(runner.model, options)
    return runner
