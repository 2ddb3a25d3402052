"""Weighted gradient compression: the exact weighting's comm hook, all-reducing in bf16 or fp16 (opt-in).

Reached through ``register_weighted_hook(ddp_model, sampler, compress="bf16")`` (or ``"fp16"``). Per bucket:

    1. scale the gradient by n_i / n  in (at least) fp32         -- the plan's weighting, runtime/weighting.py
    2. cast to the wire dtype (bf16 or fp16)
    3. SUM-all-reduce                                            -- no division by W: the weights sum to 1
    4. copy the sum back into the bucket (the parameters' dtype)

Scale first, then cast: the weighted terms n_i / n * g_i are each at most the size of the gradient the step
produces, so a value the sum can represent is never lost on the way. Casting first (as torch's
``fp16_compress_hook`` does before dividing by W, or an averaging all-reduce fed the loss-scaled gradient
n_i * W / n * g_i) overflows fp16 (max 65504) on a rank whose factor or raw gradient is large, although the
weighted sum fits. bf16 has fp32's range, so there the order only matters for rounding: scaling first rounds
once, at the cast.

The result is torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` applied to the exact weighted gradient:
the same bytes on the wire (half of fp32), the same rounding (one cast per rank, the sum in the wire dtype);
with W = 2 the two differ only in the fp32 rounding of the scaled gradient. Compression changes numerics
(about 3 significant digits for bf16, 3-4 for fp16), so it is never on unless asked: ``compress="none"`` (the
default) keeps the exact uncompressed hook.

PowerSGD is not offered: its rank-r approximation with error feedback changes the update far beyond rounding
and needs per-run tuning (rank, warm-up iterations), and no measurement here shows it faster than bf16 on the
links the planner targets. It composes the same way if wanted: scale each bucket by n_i * W / n, then call
torch's ``powerSGD_hook`` (which averages over W).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from planner.errors import ValidationError
from planner.profile import GRAD_COMPRESSIONS

if TYPE_CHECKING:
    from runtime.weighting import WeightedHookState

COMPRESSIONS = GRAD_COMPRESSIONS
"""Names accepted by ``register_weighted_hook(..., compress=)`` and ``planner train --grad-compress``."""

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_compress(compress: str) -> str:
    """``compress`` if it names a compression (``COMPRESSIONS``), else a ValidationError saying which do."""
    if compress not in COMPRESSIONS:
        raise ValidationError(f"gradient compression must be one of {', '.join(COMPRESSIONS)}, got {compress!r}")
    return compress


def _take_factor(state: WeightedHookState, bucket: dist.GradBucket) -> float:
    """n_i / n for this bucket; on the step's last bucket also the hook's step bookkeeping (as the exact hook)."""
    factor = state._factor_for_current_window()
    if bucket.is_last():
        state.last_factor = factor
        if state.on_last_bucket is not None:
            state.on_last_bucket()  # before the launch: timing records "local compute done" here
        state._advance()
    return factor


def _weighted_compressed(state: WeightedHookState, bucket: dist.GradBucket,
                         wire: torch.dtype) -> torch.futures.Future[torch.Tensor]:
    factor = _take_factor(state, bucket)
    buffer = bucket.buffer()
    if buffer.dtype in (torch.float32, torch.float64):
        scaled = buffer.mul_(factor)  # in place, as the exact hook: no second full-size buffer
    else:  # a bf16/fp16 model: scale in fp32, round once at the cast
        scaled = buffer.float().mul_(factor)
    return sum_on_wire(buffer, scaled, wire, state.process_group)


def sum_on_wire(buffer: torch.Tensor, scaled: torch.Tensor, wire: torch.dtype,
                group: dist.ProcessGroup | None) -> torch.futures.Future[torch.Tensor]:
    """Steps 2-4 above: ``scaled`` (the bucket's already weighted gradient) cast to ``wire``, SUM-all-reduced over
    ``group``, and the sum copied back into ``buffer`` (the bucket, in the parameters' dtype), which the future
    returns.  The profiler's DDP rounds send their gradients through it too (profiler.ddp)."""
    compressed = scaled.to(wire)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()  # type: ignore[union-attr]

    def decompress(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(f.value()[0])  # back to the parameters' dtype, in place (no peak of a second buffer)
        return buffer

    return fut.then(decompress)


def _bf16_weighted_hook(state: WeightedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _weighted_compressed(state, bucket, torch.bfloat16)


def _fp16_weighted_hook(state: WeightedHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return _weighted_compressed(state, bucket, torch.float16)


def weighted_hook_for(compress: str) -> Callable[..., torch.futures.Future[torch.Tensor]] | None:
    """The compressed weighted hook for ``compress`` ('bf16', 'fp16'); None for 'none' (the exact hook)."""
    check_compress(compress)
    hook = {"bf16": _bf16_weighted_hook, "fp16": _fp16_weighted_hook}.get(compress)
    if hook is not None:
        # DDP checks the hook's annotations by identity; under `from __future__ import annotations` they are strings.
        from runtime.weighting import WeightedHookState

        hook.__annotations__ = {"state": WeightedHookState, "bucket": dist.GradBucket,
                                "return": torch.futures.Future[torch.Tensor]}
    return hook


def stock_compress_hook(compress: str) -> Callable[..., torch.futures.Future[torch.Tensor]] | None:
    """torch's own averaging hook for ``compress`` (``bf16_compress_hook``, ``fp16_compress_hook``; None for
    'none'): what an equal-split DDP script registers, state None. Casts first, then divides by W."""
    check_compress(compress)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}.get(compress)
