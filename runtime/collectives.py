"""What ranks exchange, as data: JSON over tensors, never pickle.

``torch.distributed``'s object collectives (``all_gather_object``, ``broadcast_object_list``) unpickle what
peers send, so a rogue or compromised peer could run code on every rank (docs/SECURITY.md).  Everything our
ranks exchange (plans, profiles, step statistics, agreement facts, decisions) is JSON-able, so it crosses as
UTF-8 JSON bytes in a uint8 tensor and is parsed with ``json.loads``, which builds dicts, lists, strings and
numbers only.

    all_gather_json(obj)          every rank's obj, in rank order
    broadcast_json(obj, src)      src's obj on every rank
    decide_on_rank0(fn)           rank 0 runs fn(), every rank gets its result or raises its error

Used by the profiler (gathering rank profiles), the runtime (agreement check, re-plan exchange) and the
programs in ``planner.cli``.
Without an initialized process group each function acts on this process alone.
"""

from __future__ import annotations

import atexit
import ctypes
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from planner.errors import PlanError, ValidationError


class _Buffers:
    """The tensors of this process's latest exchanges, held from C++ until later ones replace them, and at exit for
    good.

    A tensor made in Python that a C++ owner also holds keeps its Python object alive through that owner, and the
    owner's release takes the GIL to hand the object back.  gloo's worker thread is such an owner: it releases a
    collective's tensors when it disposes of the finished work, a moment after ``wait`` has returned here -- and if
    the main thread has meanwhile gone on to exit the interpreter, the thread is torn down inside that destructor and
    the process aborts ("terminate called without an active exception", after the run had finished: gdb showed
    ``~AsyncAllgatherWork`` -> ``TensorImpl::decref_pyobject`` -> ``take_gil`` in ``pt_gloo_runloop``; 2 of 9 two-rank
    launches of an own loop whose last act was the epoch end's all-gather).  Held here by a second C++ owner (a
    completed ``torch.futures.Future`` holding them), the worker's release is never the one that hands the object
    back: the main thread does, with the GIL, when later exchanges replace these; and at interpreter exit the holder
    is kept alive for good (a few KB), so no release is left for the worker to make during the clean-up."""

    KEEP = 4
    """Exchanges held (an all-gather is two collectives, held as one)."""

    def __init__(self) -> None:
        self._kept: list[torch.futures.Future[list[torch.Tensor]]] = []
        self._registered = False

    def keep(self, *tensors: torch.Tensor) -> None:
        held: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        held.set_result(list(tensors))
        self._kept = [*self._kept[-(self.KEEP - 1):], held]
        if not self._registered:
            self._registered = True
            atexit.register(self.leak_at_exit)

    def leak_at_exit(self) -> None:
        """One more reference to the holder that nothing releases: the process ends with the tensors held."""
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._kept))


_BUFFERS = _Buffers()


class RemoteError(RuntimeError):
    """Raised on the other ranks when rank 0's decision failed with an internal error."""


def is_distributed(group: Any = None) -> bool:
    """True inside an initialized process group (of any size)."""
    return dist.is_available() and dist.is_initialized()


def _device(group: Any) -> torch.device:
    # NCCL moves CUDA tensors only (the current device, as torch's own object collectives do); gloo moves CPU ones.
    if str(dist.get_backend(group)) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any) -> bytes:
    # allow_nan: a NaN measurement must reach rank 0 as NaN (it refuses it there, with the rank's name).
    return json.dumps(obj, allow_nan=True, separators=(",", ":")).encode("utf-8")


def _decode(data: bytes, rank: int) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValidationError(f"rank {rank} sent data that is not JSON ({type(e).__name__}); "
                              "all ranks must run the same ddp-planner version") from None


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in group-rank order; ``[obj]`` without a process group."""
    if not is_distributed(group):
        return [obj]
    device = _device(group)
    payload = torch.frombuffer(bytearray(_encode(obj)), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.all_gather(sizes, mine, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    _BUFFERS.keep(payload, mine, *sizes, padded, *out)
    return [_decode(t[:n].cpu().numpy().tobytes(), r) for r, (t, n) in enumerate(zip(out, lengths, strict=True))]


def broadcast_json(obj: Any, src: int = 0, group: Any = None) -> Any:
    """``obj`` of group rank ``src`` on every rank (the others pass anything, e.g. None)."""
    if not is_distributed(group):
        return obj
    device = _device(group)
    me = dist.get_rank(group)
    global_src = src if group is None else dist.get_global_rank(group, src)
    data = _encode(obj) if me == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=global_src, group=group)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if me == src
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=global_src, group=group)
    _BUFFERS.keep(size, buf)
    return obj if me == src else _decode(buf.cpu().numpy().tobytes(), src)


def decide_on_rank0(decide: Callable[[], Any], group: Any = None) -> Any:
    """Rank 0 runs ``decide()`` and broadcasts its JSON-able result; every rank returns it.

    An error on rank 0 reaches every rank, so no rank is left waiting: a user error (ValidationError,
    PlanError) is raised with the same type and message everywhere (every rank exits 2 with the same line);
    any other error is re-raised on rank 0 and raised as ``RemoteError`` naming it on the others.
    """
    if not is_distributed(group):
        return decide()
    own: BaseException | None = None
    payload: dict[str, Any] = {}
    if dist.get_rank(group) == 0:
        try:
            payload = {"ok": decide()}
        except Exception as e:  # every rank must learn of it, or the others hang in the broadcast
            own = e
            kind = "validation" if isinstance(e, ValidationError) else "plan" if isinstance(e, PlanError) else "other"
            payload = {"error": f"{e}", "kind": kind, "type": type(e).__name__}
    payload = broadcast_json(payload, 0, group)
    if "error" not in payload:
        return payload["ok"]
    if own is not None:
        raise own
    if payload["kind"] == "validation":
        raise ValidationError(payload["error"])
    if payload["kind"] == "plan":
        raise PlanError(payload["error"])
    raise RemoteError(f"rank 0 failed: {payload['type']}: {payload['error']}")


__all__ = ["RemoteError", "all_gather_json", "broadcast_json", "decide_on_rank0", "is_distributed"]
